"""`kvpool bench faults`: its table and verdict from a fixed report, the SSD rows without an
SSD tier, and the trace hit-rate replay through a real pool (a short prefix of the trace)."""

from __future__ import annotations

import subprocess
import sys

from kvpool.bench.faults import format_table, healthy
from kvpool.bench.faults_ssd import NA, hit_rate_rows, ssd_read_rows, ssd_tier_available
from tests.support.procs import python_env

REPORT = {
    "ha": {"failover_s": [2.1, 2.4, 2.2], "failover_median_s": 2.2, "acked": 450, "lost": 0,
           "wrong": 0, "window_errors": {"put:RPC_TIMEOUT": 2}, "lease_ttl_s": 2},
    "node": {"objects": 200, "lost_at_once": 0, "lost_after_ttl": 0, "wrong": 0,
             "read_all_s": 0.3, "puts_resume": True, "errors": {}},
}


def test_table_rows_and_verdict() -> None:
    lines = format_table(REPORT)
    assert lines[0].startswith("figure") and "value" in lines[0]
    assert any("first put on new leader" in line and "2.20 s" in line for line in lines)
    assert any("put:RPC_TIMEOUT x2" in line for line in lines)
    assert any("0 / 0 of 200" in line for line in lines)
    assert healthy(REPORT)
    assert not healthy({**REPORT, "node": {**REPORT["node"], "lost_after_ttl": 1}})
    assert not healthy({**REPORT, "ha": {**REPORT["ha"], "wrong": 1}})


def test_ssd_rows_say_na_without_an_ssd_tier() -> None:
    help_text = subprocess.run([sys.executable, "-m", "kvpool", "store-node", "--help"],
                               capture_output=True, text=True, env=python_env()).stdout
    assert ssd_tier_available() == ("--ssd" in help_text)
    assert ssd_read_rows(False) == {"dram_read_gb_s": NA, "ssd_read_gb_s": NA,
                                    "promotions_per_s": NA}


def test_trace_replay_through_a_real_pool_tracks_the_simulated_lru() -> None:
    row = hit_rate_rows(300, with_ssd=False)
    assert row["requests"] == 300 and row["dram_ssd"] == NA
    assert row["dram_blocks"] == -(-row["distinct_blocks"] // 10)
    pool = row["dram"]
    assert pool["wrong"] == 0 and pool["failed_puts"] == 0
    assert 0 < pool["hit_rate"] <= row["sim_unbounded_hit_rate"]
    assert abs(pool["hit_rate"] - row["sim_lru_hit_rate"]) < 0.05, row


def test_registered_as_a_bench() -> None:
    out = subprocess.run([sys.executable, "-m", "kvpool", "bench", "faults", "--help"],
                         capture_output=True, text=True, env=python_env())
    assert out.returncode == 0 and "--trials" in out.stdout and "--json" in out.stdout
