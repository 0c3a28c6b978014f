"""`kvpool bench proxy-vllm`: its stream check and ratios by default; the whole bench,
briefly, in the slow job (real processes: the emulated vLLM face and the proxy in front)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvpool.bench.proxy_vllm import _whole, with_direct_ratios
from tests.support.procs import python_env


def test_a_stream_is_whole_only_with_its_finish_and_done() -> None:
    ok = b'data: {"choices": [{"finish_reason": "length"}]}\n\ndata: [DONE]\n\n'
    assert _whole(ok, 16) == 16
    for cut in (ok[:-8], ok.replace(b'"length"', b'"stop"')):
        with pytest.raises(ValueError, match="not whole"):
            _whole(cut, 16)


def test_the_proxys_rows_get_their_ratio_over_the_direct_row_of_the_same_load() -> None:
    rows = with_direct_ratios([
        {"relay": "kvpool-vllm", "load": "req16", "req_per_s": 150.0},
        {"relay": "vllm-direct", "load": "req16", "req_per_s": 200.0},
        {"relay": "kvpool-vllm", "load": "stream256", "req_per_s": 9.0}])
    assert rows[0]["ratio_req_per_s"] == 0.75
    assert "ratio_req_per_s" not in rows[1] and "ratio_req_per_s" not in rows[2]
    assert {r["bench"] for r in rows} == {"proxy-vllm"}


@pytest.mark.slow
def test_the_bench_runs_both_ways_and_every_stream_is_whole() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvpool", "bench", "proxy-vllm", "--json", "--rounds", "1",
         "--streams", "4", "--requests", "16", "--concurrency", "4"],
        capture_output=True, text=True, timeout=300, env=python_env())
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert sorted((r["relay"], r["load"], r["requests"]) for r in rows) == [
        ("kvpool-vllm", "req16", 16), ("kvpool-vllm", "stream256", 4),
        ("vllm-direct", "req16", 16), ("vllm-direct", "stream256", 4)]
    for r in rows:
        assert r["tokens"] == r["requests"] * (16 if r["load"] == "req16" else 256), r
        if r["relay"] == "kvpool-vllm":
            assert r["relay_ms_per_request"] > 0 and r["ratio_req_per_s"] > 0, r
