"""The claims docs/sim.md makes about each experiment, on the whole conversation trace.

Slow (5-20 s each): run with `pytest -m slow tests/sim`.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvpool.sim.experiments import EXPERIMENTS, ExperimentOptions

pytestmark = pytest.mark.slow


def rows(name: str) -> list[dict[str, Any]]:
    return EXPERIMENTS[name](ExperimentOptions(progress=False)).rows


def pick(table: list[dict[str, Any]], **match: Any) -> dict[str, Any]:
    return next(r for r in table if all(r[k] == v for k, v in match.items()))


def test_scheduling_order_matches_the_paper() -> None:
    table = rows("scheduling")
    for split in ("8P8D", "6P10D"):
        ttft = [pick(table, split=split, policy=p)["mean_ttft_s"]
                for p in ("kvcache_centric", "cache_aware", "load_balance", "random")]
        assert ttft == sorted(ttft)


def test_capacity_mooncake_beats_every_baseline_most_at_100ms() -> None:
    table = rows("capacity")
    gains = [pick(table, system="mooncake", tbt_threshold_ms=t)["gain_pct"]
             for t in (100, 200, 300)]
    assert all(g >= 0 for g in gains) and gains[0] == max(gains) and gains[0] > 50
    ratios = {r["system"]: r["prefill_ratio"] for r in table}
    assert ratios["vllm_prefix"] < ratios["vllm"] and min(ratios.values()) == 1.0


def test_overload_order_in_the_balanced_regime() -> None:
    table = rows("overload")
    balanced = [pick(table, regime="balanced", admission=a)["rejected"]
                for a in ("none", "early_rejection", "early_rejection_predicted")]
    assert balanced[0] > balanced[1] > balanced[2]
    assert pick(table, regime="balanced", admission="none")["rejected_decode"] > 0
    assert pick(table, regime="balanced", admission="none")["decode_factor"] > 2
    for name in ("calibrated", "matched"):  # decode never binds: the policies agree
        assert len({r["rejected"] for r in table if r["regime"] == name}) == 1
        assert all(r["rejected_decode"] == 0 for r in table if r["regime"] == name)
    matched = pick(table, regime="matched", admission="none")
    assert 2.0 < matched["speed"] < 2.1 and matched["tbt_slo_ms"] == pytest.approx(133.2, abs=0.1)


def test_capacity_chunked_prefill_time_ratio_is_calibrated_to_the_paper() -> None:
    table = rows("capacity")
    chunked = pick(table, system="vllm_chunked", tbt_threshold_ms=100)
    assert chunked["prefill_ratio"] == pytest.approx(1.90, abs=0.02)
    # VRAM never binds at the trace's rate: no preemption, at most 40% of the KV capacity held
    for r in table:
        if r["system"] != "mooncake":
            assert r["preemptions"] == 0 and r["peak_kv_share"] < 0.4


def test_capacity_ablation_the_chunk_overhead_matters_most() -> None:
    table = rows("capacity-ablation")
    on = pick(table, system="vllm_chunked", setting="all on")
    no_overhead = pick(table, system="vllm_chunked", setting="without chunk_overhead_s")
    assert no_overhead["effective_100ms"] > on["effective_100ms"] + 0.2
    for system in ("vllm", "vllm_prefix", "vllm_chunked"):
        same = pick(table, system=system, setting="without preempt_recompute")
        assert same == pick(table, system=system, setting="all on") | {
            "setting": "without preempt_recompute"}


def test_global_pool_beats_local_caches() -> None:
    table = rows("global-vs-local")
    loc, glob = pick(table, policy="cache_aware"), pick(table, policy="kvcache_centric")
    assert glob["hit_rate"] > loc["hit_rate"]
    assert glob["prefill_gpu_s"] < loc["prefill_gpu_s"]


def test_bandwidth_ttft_falls_with_bandwidth() -> None:
    table = rows("bandwidth")
    ttft = [r["mean_ttft_s"] for r in table if r["bandwidth_gbps"] != "recompute"]
    assert ttft == sorted(ttft, reverse=True)
    recompute = pick(table, bandwidth_gbps="recompute")["mean_ttft_s"]
    assert ttft[0] > recompute > ttft[1]  # 24 Gbps is worse than recomputing, 40 is better


def test_pd_ratio_ttft_falls_and_tbt_rises_with_prefill_share() -> None:
    table = rows("pd-ratio")
    assert [r["mean_ttft_s"] for r in table] == sorted(r["mean_ttft_s"] for r in table)[::-1]
    assert [r["mean_tbt_ms"] for r in table] == sorted(r["mean_tbt_ms"] for r in table)
