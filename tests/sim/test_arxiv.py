"""The pieces of the [A] §8.1 experiments, worked out by hand: synthetic workloads and their
cache ratio, the lone-request SLO limits, the max-RPS search, and one request at a time on a
colocated instance."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from kvpool.conductor import Conductor, ConductorConfig, CostModel
from kvpool.errors import InvalidArgument
from kvpool.sim.colocated import ColocatedConfig, ColocatedSim, VllmConfig
from kvpool.sim.disagg import DisaggConfig, DisaggSim
from kvpool.sim.engine import EngineConfig
from kvpool.sim.experiments.common import NO_SLO_S
from kvpool.sim.experiments.maxrps import (
    Point,
    SearchSpec,
    SloLimits,
    System,
    find_max_rps,
    lone_limits,
    measure,
)
from kvpool.sim.metrics import SimResult
from kvpool.sim.synth import (
    ARXIV,
    LEVAL,
    LengthDist,
    WorkloadSpec,
    cache_ratio,
    generate,
    shared_blocks,
    simulated,
    with_rate,
)
from kvpool.sim.trace import TraceRequest
from tests.sim.conftest import SIMPLE_COST, trace_of

COST = CostModel(prefill_base_s=0.1, prefill_linear_s=1e-4, prefill_quadratic_s=1e-9,
                 decode_base_s=0.04, decode_per_seq_s=0.001, decode_per_token_s=1e-8,
                 decode_join_s=0.05)


# ---- synthetic workloads
def test_pool_documents_give_the_target_ratio_once_warm() -> None:
    reqs = generate(simulated(16_384), 400, seed=3)
    assert {r.input_len for r in reqs} == {16_384} and {r.output_len for r in reqs} == {512}
    assert all(len(r.block_hashes) == 32 for r in reqs)
    # 8 documents of 16 shared blocks; only each document's first use misses its half
    assert cache_ratio(reqs) == pytest.approx(0.5 * (400 - 8) / 400)


def test_dataset_specs_match_table_2() -> None:
    arxiv, leval = generate(ARXIV, 2000, seed=1), generate(LEVAL, 2000, seed=1)
    assert np.mean([r.input_len for r in arxiv]) == pytest.approx(8088, rel=0.03)
    assert np.mean([r.output_len for r in arxiv]) == pytest.approx(229, rel=0.03)
    assert cache_ratio(arxiv) == 0.0
    assert np.mean([r.input_len for r in leval]) == pytest.approx(19019, rel=0.05)
    assert np.mean([r.output_len for r in leval]) == pytest.approx(72, rel=0.05)
    assert 0.8 < cache_ratio(leval) == pytest.approx(LEVAL.warm_ratio(), abs=0.02)


def test_groups_share_their_document_and_keep_a_unique_tail() -> None:
    spec = WorkloadSpec("g", LengthDist(2048), LengthDist(4), group_size=2).with_ratio(0.25)
    assert spec.doc_share == 0.5 and shared_blocks(2048, 0.5) == 2
    a, b, c, _ = generate(spec, 4)
    assert a.block_hashes[:2] == b.block_hashes[:2] and a.block_hashes[2:] != b.block_hashes[2:]
    assert not set(a.block_hashes) & set(c.block_hashes)
    assert cache_ratio([a, b, c]) == pytest.approx(1024 / (3 * 2048))
    assert generate(spec, 4, seed=5) == generate(spec, 4, seed=5)
    with pytest.raises(InvalidArgument):
        spec.with_ratio(0.6)  # more than the groups' second halves can reuse


def test_poisson_rates_only_scale_the_arrivals() -> None:
    reqs = generate(ARXIV, 50)
    slow, fast = with_rate(reqs, 0.5, seed=2), with_rate(reqs, 2.0, seed=2)
    assert [4 * r.arrival_s for r in fast] == pytest.approx([r.arrival_s for r in slow])


# ---- SLO limits
def test_lone_limits_by_hand() -> None:
    limits = lone_limits(COST, 10_000, 101)
    # TTFT: 10 x (0.1 + 1e-4 * 1e4 + 1e-9 * 1e8) = 12 s
    assert limits.ttft_s == pytest.approx(12.0)
    # TBT, mean gap: 5 x (0.04 + 0.001 + 1e-8 * 1e4 + 0.05 / 100) = 0.208 s
    assert limits.tbt_s == pytest.approx(0.208) and limits.stat == "mean"
    # TBT, longest 10%: 5 x (0.0411 + 0.05 / ceil(0.1 * 100)) = 0.2305 s
    assert lone_limits(COST, 10_000, 101, "top10").tbt_s == pytest.approx(0.2305)
    with pytest.raises(InvalidArgument):
        lone_limits(COST, 10_000, 101, "p99")


def test_lone_limits_are_the_lone_mooncake_request() -> None:
    req = TraceRequest(0, 0.0, 10_000, 101, tuple(range(20)))
    conductor = Conductor(ConductorConfig(admission="none", ttft_slo_s=NO_SLO_S,
                                          tbt_slo_s=NO_SLO_S), COST)
    rec = DisaggSim(conductor, DisaggConfig(num_prefill=1, num_decode=1)).run([req]).records[0]
    limits, top10 = lone_limits(COST, 10_000, 101), lone_limits(COST, 10_000, 101, "top10")
    assert 10 * rec.ttft_s == pytest.approx(limits.ttft_s)
    assert 5 * rec.mean_gap_s == pytest.approx(limits.tbt_s, rel=1e-5)
    assert 5 * rec.tbt_s == pytest.approx(top10.tbt_s, rel=1e-5)  # context grows by 1 token


# ---- the search
def _threshold(limit_rps: float, seen: list[float]) -> Callable[[float], Point]:
    def probe(rps: float) -> Point:
        seen.append(rps)
        return Point(rps, rps, rps, rps <= limit_rps)
    return probe


def test_search_doubles_then_bisects() -> None:
    seen: list[float] = []
    best, points = find_max_rps(_threshold(0.7, seen), SearchSpec())
    assert seen[:5] == pytest.approx([0.05, 0.1, 0.2, 0.4, 0.8]) and len(points) == 10
    assert best is not None and 0.7 * 2 ** (-1 / 32) <= best.rps <= 0.7


def test_search_goes_down_and_can_find_nothing() -> None:
    seen: list[float] = []
    best, _ = find_max_rps(_threshold(0.01, seen), SearchSpec())
    assert seen[:4] == pytest.approx([0.05, 0.025, 0.0125, 0.00625])
    assert best is not None and 0.01 * 2 ** (-1 / 32) <= best.rps <= 0.01
    nothing, points = find_max_rps(_threshold(1e-4, []), SearchSpec())
    assert nothing is None and min(p.rps for p in points) >= 1e-3


def test_measure_takes_the_p90_of_lone_requests() -> None:
    reqs = [TraceRequest(i, 0.0, 1000 * (1 + i % 2), 2, (i,)) for i in range(10)]
    config = ColocatedConfig(num_instances=1, vllm=VllmConfig(max_num_seqs=1))

    def run(rs: Sequence[TraceRequest]) -> SimResult:
        return ColocatedSim(SIMPLE_COST, config).run(rs)
    system: System = run
    # 0.01 req/s: every request is alone; TTFT 1 s or 2 s, TBT one 10 ms step
    point = measure(system, reqs, 0.01, SloLimits(2.0, 0.01))
    assert point.p90_ttft_s == pytest.approx(2.0) and point.p90_tbt_s == pytest.approx(0.01)
    assert point.ok and not measure(system, reqs, 0.01,
                                    SloLimits(1.9, 0.01)).ok


# ---- one request at a time
ONE_AT_A_TIME = [(0.0, 1000, 3, [1, 2]), (0.1, 500, 2, [3])]


def test_max_one_sequence_waits_for_the_running_request(tmp_path: Path) -> None:
    cfg = ColocatedConfig(num_instances=1, vllm=replace(VllmConfig(), max_num_seqs=1))
    res = ColocatedSim(SIMPLE_COST, cfg).run(trace_of(tmp_path, ONE_AT_A_TIME))
    # a: prefill 0 .. 1.0, two decode steps .. 1.02; b's prefill only then: 1.02 .. 1.52
    assert [r.ttft_s for r in res.records] == pytest.approx([1.0, 1.42])
    assert [r.finish_s for r in res.records] == pytest.approx([1.02, 1.53])
    assert [r.tbt_s for r in res.records] == pytest.approx([0.01, 0.01])


def test_default_limit_lets_the_prompt_interrupt(tmp_path: Path) -> None:
    res = ColocatedSim(SIMPLE_COST, ColocatedConfig(num_instances=1)).run(
        trace_of(tmp_path, ONE_AT_A_TIME))
    # b's prefill runs right after a's (1.0 .. 1.5); a stalls through it, then both decode
    assert [r.ttft_s for r in res.records] == pytest.approx([1.0, 1.4])
    assert [r.finish_s for r in res.records] == pytest.approx([1.52, 1.51])


def test_max_one_sequence_with_chunked_prefill(tmp_path: Path) -> None:
    cfg = ColocatedConfig(num_instances=1, engine=EngineConfig(chunk_tokens=500),
                           vllm=VllmConfig(max_num_seqs=1, chunk_overhead_s=0.0))
    res = ColocatedSim(SIMPLE_COST, cfg).run(trace_of(tmp_path, ONE_AT_A_TIME))
    # a: two 500-token chunks (0.5 s each) .. 1.0, then two decode steps .. 1.02;
    # b starts only then: one chunk .. 1.52, one decode step .. 1.53
    assert [r.ttft_s for r in res.records] == pytest.approx([1.0, 1.42])
    assert [r.finish_s for r in res.records] == pytest.approx([1.02, 1.53])
