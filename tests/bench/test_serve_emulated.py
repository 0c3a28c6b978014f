"""`kvpool bench serve --engine emulated` from the command line, reduced (2P2D and 2 colocated
workers, 20 s of the trace at 4x): every answer equals its prompt's expected output, nothing is
left behind, and the live figures stand beside the simulator's of the same run."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support.procs import python_env


@pytest.mark.slow
@pytest.mark.timeout(600)  # three runs of 20 s of the trace, each a cluster of 4-6 workers
def test_the_emulated_fleet_bench_runs_and_loses_nothing() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvpool", "bench", "serve", "--engine", "emulated", "--json",
         "--window", "20", "--speed-up", "4", "--prefill", "2", "--decode", "2",
         "--colocated", "2", "--runs", "1,7,9", "--pool-dram", "512MiB",
         "--direct-below-tokens", "4096"],
        capture_output=True, text=True, timeout=600, env=python_env())
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [r["config"] for r in rows] == ["2P2D kvcache_centric none", "2M vllm",
                                           "2P2D kvcache_centric none direct<=4096"]
    direct = rows.pop()  # conditional disaggregation: short requests skip the prefill worker
    assert direct["output_mismatches"] == 0 and direct["leftovers"] == [], direct
    assert direct["ok"] + direct["rejected"] == direct["requests"] and direct["sim"] == {}, direct
    assert 0 < direct["direct_requests"] < direct["requests"], direct
    assert rows[0]["direct_requests"] == 0
    for r in rows:
        assert r["requests"] > 40 and r["ok"] + r["rejected"] == r["requests"], r
        assert r["output_mismatches"] == 0 and r["leftovers"] == [], r
        assert abs(r["prefix_hit_rate"] - r["sim"]["prefix_hit_rate"]) <= 0.02, r
        assert r["speed_up"] == 4 and 0 < r["kv_scale"] <= 1
    assert rows[0]["kv_bytes_moved"] > 0 and rows[1]["kv_bytes_moved"] == 0


@pytest.mark.slow
@pytest.mark.timeout(600)  # two runs of 20 s of the trace at 4x, each a cluster of 4 workers
def test_through_the_vllm_backend_the_pool_brings_the_reuse_nixl_cannot() -> None:
    """The fleet behind vLLM's face through the proxy's vllm backend, once as instances on
    vLLM's store connector and once on NIXL (`--kv-connector`), on the window whose reuse is
    across a conversation's turns: every answer exact, nothing left behind, and the store
    connector reuses far more of the prompts (the previous turn's context is in the decode
    instance that answered it, which only the pool brings to a prefill instance)."""
    hits = {}
    for connector in ("store", "nixl"):
        out = subprocess.run(
            [sys.executable, "-m", "kvpool", "bench", "serve", "--engine", "emulated", "--json",
             "--backend", "vllm", "--kv-connector", connector, "--window-start", "1680",
             "--window", "20", "--speed-up", "4", "--prefill", "2", "--decode", "2",
             "--runs", "1", "--pool-dram", "512MiB"],
            capture_output=True, text=True, timeout=300, env=python_env())
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
        row, = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
        assert row["output_mismatches"] == 0 and row["leftovers"] == [], row
        assert row["ok"] + row["rejected"] == row["requests"] > 40 and row["failed"] == 0, row
        hits[connector] = row["prefix_hit_rate"]
    assert hits["store"] > hits["nixl"] + 0.05, hits
