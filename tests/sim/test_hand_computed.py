"""Small scenarios whose TTFTs and TBTs were worked out by hand (see comments)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from kvpool.conductor import Conductor, ConductorConfig
from kvpool.sim.colocated import ColocatedConfig, ColocatedSim, VllmConfig
from kvpool.sim.disagg import DisaggConfig, DisaggSim
from kvpool.sim.engine import EngineConfig
from tests.sim.conftest import SIMPLE_COST, trace_of

# prefill 1 ms/token; decode step 10 ms; KV transfer 1 us/token
OFF = VllmConfig.off()


def test_disaggregated_two_prefill_one_decode(tmp_path: Path) -> None:
    reqs = trace_of(tmp_path, [
        (0.0, 2048, 3, [1, 2, 3, 4]),        # P0: 2.048 s
        (0.0, 2048, 2, [5, 6, 7, 8]),        # P1 (P0 queued until 2.048): 2.048 s
        (2.1, 8192, 2, list(range(10, 26))),  # both idle, no prefix: tie -> P0, 8.192 s
        (2.1, 2560, 2, [1, 2, 3, 4, 9]),     # P0 holds 4 blocks but is busy until 10.292;
    ])                                       # P1 fetches 2048 tokens (2.048 ms) + 0.512 s
    conductor = Conductor(ConductorConfig(admission="none"), SIMPLE_COST)
    sim = DisaggSim(conductor, DisaggConfig(num_prefill=2, num_decode=1))
    res = sim.run(reqs)
    assert [r.ttft_s for r in res.records] == pytest.approx([2.048, 2.048, 8.192, 0.514048])
    # r0 joins at 2.048; r1's KV arrives at the same instant, so it joins at the next step
    # boundary (2.058): its first decode gap is 20 ms. Both finish at 2.068.
    assert [r.tbt_s for r in res.records] == pytest.approx([0.01, 0.02, 0.01, 0.01])
    assert [r.finish_s for r in res.records] == pytest.approx([2.068, 2.068, 10.302, 2.624048])
    assert res.hit_rate() == pytest.approx(2048 / 14848)
    assert res.rejected() == 0
    assert all(b in sim.caches[1] for b in (1, 2, 3, 4, 9))  # hot prefix replicated on P1
    assert sim.view.index.match([1, 2, 3, 4, 9]).lens == {0: 4, 1: 5}


def test_colocated_whole_prefill_stalls_running_decodes(tmp_path: Path) -> None:
    reqs = trace_of(tmp_path, [(0.0, 1000, 3, [1, 2]), (0.5, 500, 2, [3])])
    res = ColocatedSim(SIMPLE_COST, ColocatedConfig(num_instances=1, vllm=OFF)).run(reqs)
    # a: prefill 0..1.0; b's prefill 1.0..1.5 stalls a; decode steps at 1.51 and 1.52
    assert [r.ttft_s for r in res.records] == pytest.approx([1.0, 1.0])
    assert [r.finish_s for r in res.records] == pytest.approx([1.52, 1.51])
    assert [r.tbt_s for r in res.records] == pytest.approx([0.51, 0.01])
    assert res.prefill_gpu_s() == pytest.approx(0.75)


def test_colocated_chunked_prefill_spreads_the_stall(tmp_path: Path) -> None:
    reqs = trace_of(tmp_path, [(0.0, 1000, 3, [1, 2]), (0.5, 500, 2, [3])])
    cfg = ColocatedConfig(num_instances=1, engine=EngineConfig(chunk_tokens=400), vllm=OFF)
    res = ColocatedSim(SIMPLE_COST, cfg).run(reqs)
    # a: chunks 400+400+200 -> first token 1.0; b: 399 tokens + a's decode in one pass
    # (0.399 s: the decode's fixed 10 ms hides under the chunk), then 101 tokens + a's last
    # decode (0.101 s) -> first token 1.5; b decodes alone until 1.51
    assert [r.ttft_s for r in res.records] == pytest.approx([1.0, 1.0])
    assert [r.finish_s for r in res.records] == pytest.approx([1.5, 1.51])
    assert [r.tbt_s for r in res.records] == pytest.approx([0.399, 0.01])


def test_colocated_prefix_cache_skips_cached_blocks(tmp_path: Path) -> None:
    reqs = trace_of(tmp_path, [(0.0, 1024, 1, [1, 2]), (5.0, 1536, 1, [1, 2, 3])])
    cfg = ColocatedConfig(num_instances=1, engine=EngineConfig(prefix_cache_blocks=10),
                          vllm=OFF)
    res = ColocatedSim(SIMPLE_COST, cfg).run(reqs)
    assert [r.ttft_s for r in res.records] == pytest.approx([1.024, 0.512])
    assert res.hit_rate() == pytest.approx(1024 / 2560)


def test_baseline_rejects_at_decode_after_prefill(tmp_path: Path) -> None:
    # KV capacity 3000 tokens. r0 (1024 tokens, 199 decode steps) decodes 1.024 .. 3.014;
    # r1's 2048-token KV arrives at 2.048 and does not fit beside it.
    reqs = trace_of(tmp_path, [(0.0, 1024, 200, [1, 2]), (0.0, 2048, 3, [3, 4, 5, 6])])
    for admission, stage in (("none", "decode"), ("early_rejection", None)):
        conductor = Conductor(ConductorConfig(admission=admission), SIMPLE_COST)
        cfg = DisaggConfig(num_prefill=2, num_decode=1,
                           engine=EngineConfig(kv_capacity_tokens=3000))
        res = DisaggSim(conductor, cfg).run(reqs)
        assert res.records[1].rejected_stage == stage
        assert res.records[0].finish_s == pytest.approx(3.014)
    assert res.records[1].rejected_reason is None
    # early rejection lets it wait for VRAM instead: it joins when the first one leaves
    assert res.records[1].finish_s == pytest.approx(3.034)


def test_a_join_lengthens_the_step_it_joins_on_disaggregated_decode_only(tmp_path: Path) -> None:
    cost = replace(SIMPLE_COST, decode_join_s=0.005)
    rows = [(0.0, 1024, 4, [1, 2]),   # prefill 1.024 s, joins at 1.024: steps 15, 10, 10 ms
            (0.0, 1024, 3, [3, 4])]   # queued until 1.024, prefill to 2.048: steps 15, 10 ms
    reqs = trace_of(tmp_path, rows)
    sim = DisaggSim(Conductor(ConductorConfig(admission="none"), cost),
                    DisaggConfig(num_prefill=1, num_decode=1))
    res = sim.run(reqs)
    assert [r.finish_s for r in res.records] == pytest.approx([1.059, 2.073])
    assert [r.tbt_s for r in res.records] == pytest.approx([0.015, 0.015])  # the join step
    free = DisaggSim(Conductor(ConductorConfig(admission="none"), SIMPLE_COST),
                     DisaggConfig(num_prefill=1, num_decode=1)).run(reqs)
    assert [r.tbt_s for r in free.records] == pytest.approx([0.01, 0.01])
    # colocated instances compute their KV in place: no join cost
    colo = ColocatedSim(cost, ColocatedConfig(num_instances=1, vllm=OFF)).run(reqs[:1])
    assert colo.records[0].tbt_s == pytest.approx(0.01)
