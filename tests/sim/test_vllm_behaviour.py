"""The vLLM v0.5.1 behaviours of the colocated baseline, each worked out by hand, on and off."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from kvpool.errors import ConfigError, InvalidArgument
from kvpool.sim.cache import BlockCache
from kvpool.sim.colocated import ColocatedConfig, ColocatedSim, VllmConfig
from kvpool.sim.engine import EngineConfig
from tests.sim.conftest import SIMPLE_COST, trace_of

# SIMPLE_COST: prefill 1 ms/token, decode step 10 ms; BASE_COST adds 0.1 s per prefill step
BASE_COST = replace(SIMPLE_COST, prefill_base_s=0.1)
THREE = [(0.0, 1000, 3, [1, 2]), (0.5, 500, 2, [3]), (0.6, 300, 2, [4])]


def test_waiting_prompts_share_one_prefill_step(tmp_path: Path) -> None:
    res = ColocatedSim(BASE_COST, ColocatedConfig(num_instances=1)).run(trace_of(tmp_path, THREE))
    # a: 0.1 + 1.0 -> 1.1. b and c wait, then run as one step: 0.1 + 0.5 + 0.3 -> 2.0.
    # a stalls through that step (gap 0.9 + 0.01); b and c join at 2.0 and decode once.
    assert [r.ttft_s for r in res.records] == pytest.approx([1.1, 1.5, 1.4])
    assert [r.finish_s for r in res.records] == pytest.approx([2.02, 2.01, 2.01])
    assert [r.tbt_s for r in res.records] == pytest.approx([0.91, 0.01, 0.01])
    # the step's fixed cost is shared by the prompts in it
    assert [r.prefill_gpu_s for r in res.records] == pytest.approx([1.1, 0.55, 0.35])


def test_one_prompt_per_step_when_batching_is_off(tmp_path: Path) -> None:
    cfg = ColocatedConfig(num_instances=1, vllm=replace(VllmConfig(), batch_prefills=False))
    res = ColocatedSim(BASE_COST, cfg).run(trace_of(tmp_path, THREE))
    # b: 1.1 .. 1.7; c: 1.7 .. 2.1 (each pays the fixed cost)
    assert [r.ttft_s for r in res.records] == pytest.approx([1.1, 1.2, 1.5])
    assert [r.prefill_gpu_s for r in res.records] == pytest.approx([1.1, 0.6, 0.4])


def test_batch_stops_at_the_token_budget(tmp_path: Path) -> None:
    cfg = ColocatedConfig(num_instances=1, vllm=VllmConfig(max_num_batched_tokens=700))
    res = ColocatedSim(BASE_COST, cfg).run(trace_of(tmp_path, THREE))
    # b (500) fits, b + c (800) does not: b alone 1.1 .. 1.7, then c 1.7 .. 2.1
    assert [r.ttft_s for r in res.records] == pytest.approx([1.1, 1.2, 1.5])


def test_chunks_pay_the_step_overhead_and_fill_the_budget(tmp_path: Path) -> None:
    reqs = trace_of(tmp_path, [(0.0, 1000, 3, [1, 2]), (0.0, 300, 2, [3])])
    cfg = ColocatedConfig(num_instances=1, engine=EngineConfig(chunk_tokens=400),
                          vllm=VllmConfig(chunk_overhead_s=0.05))
    res = ColocatedSim(SIMPLE_COST, cfg).run(reqs)
    # steps: a400 (0.45), a400 (0.45), a200+b200 (0.45) -> a's first token 1.35;
    # b100 + a's decode in one pass: max(0.1, 0.01 fixed) + 0.05 -> 1.50 (the decode step's
    # fixed 10 ms hides under the chunk's compute); then one decode step for both
    assert [r.ttft_s for r in res.records] == pytest.approx([1.35, 1.50])
    assert [r.finish_s for r in res.records] == pytest.approx([1.51, 1.51])
    assert [r.tbt_s for r in res.records] == pytest.approx([0.15, 0.01])
    # the overhead of a shared step is split by tokens
    assert [r.prefill_gpu_s for r in res.records] == pytest.approx([1.125, 0.375])


def test_a_mixed_step_pays_the_decodes_per_sequence_and_per_token_terms(tmp_path: Path) -> None:
    cost = replace(SIMPLE_COST, decode_base_s=0.2, decode_per_seq_s=0.003,
                   decode_per_token_s=1e-5)
    cfg = ColocatedConfig(num_instances=1, engine=EngineConfig(chunk_tokens=400),
                          vllm=VllmConfig(chunk_overhead_s=0.05))
    # a's prompt alone: 0.1 + 0.05 -> 0.15. b's 300-token chunk then rides with a's decode in
    # one pass: the chunk's 0.3 s of compute hides the decode's fixed 0.2 s, the decode adds
    # 0.003 (one sequence) + 1e-5 x 100 (a's context) and the step pays 0.05 -> 0.504
    reqs = trace_of(tmp_path, [(0.0, 100, 3, [1]), (0.0, 300, 2, [2])])
    a, b = ColocatedSim(cost, cfg).run(reqs).records
    assert [r.ttft_s for r in (a, b)] == pytest.approx([0.15, 0.504])
    # then a decode-only step for both: 0.2 + 2 x 0.003 + 1e-5 x (101 + 300)
    assert [r.finish_s for r in (a, b)] == pytest.approx([0.504 + 0.21001] * 2)
    # a 150-token chunk computes in less than the fixed 0.2 s, which then sets the pass:
    # a 0.15; a's decode-only step 0.2 + 0.003 + 0.001 -> 0.354 (b arrives at 0.3 meanwhile);
    # b's chunk with a's decode: max(0.15, 0.2) + 0.003 + 1e-5 x 101 + 0.05 -> 0.60801
    reqs = trace_of(tmp_path, [(0.0, 100, 3, [1]), (0.3, 150, 2, [2])])
    a, b = ColocatedSim(cost, cfg).run(reqs).records
    assert [r.ttft_s for r in (a, b)] == pytest.approx([0.15, 0.60801 - 0.3])


def test_a_decode_step_runs_eagerly_above_the_captured_context(tmp_path: Path) -> None:
    # a: a 8190-token prompt, 4 decode steps after its first token; a step reads the KV held
    # when it starts (8190, 8191, 8192, 8193 tokens): the first three replay the graph (10 ms),
    # the last runs eagerly (10 ms + the 50 ms eager cost)
    reqs = trace_of(tmp_path, [(0.0, 8190, 5, [1])])
    cfg = ColocatedConfig(num_instances=1, vllm=VllmConfig(eager_decode_s=0.05))
    (a,) = ColocatedSim(SIMPLE_COST, cfg).run(reqs).records
    assert a.ttft_s == pytest.approx(8.19)
    assert a.finish_s == pytest.approx(8.19 + 3 * 0.01 + 0.06)
    assert a.tbt_s == pytest.approx(0.06)  # the longest of its 4 gaps
    off = ColocatedConfig(num_instances=1,
                          vllm=VllmConfig(eager_decode_s=0.05, max_seq_len_to_capture=0))
    (b,) = ColocatedSim(SIMPLE_COST, off).run(reqs).records
    assert b.finish_s == pytest.approx(8.19 + 4 * 0.01)


def _prefix_run(tmp_path: Path, shared: bool) -> list[float | None]:
    reqs = trace_of(tmp_path, [
        (0.0, 1024, 1100, [1, 2]),     # decodes until ~12 s, holding 2124 tokens = 5 blocks
        (1.5, 1536, 2, [3, 4, 5]),     # cached while r0 runs: only 6 - 5 = 1 block is free
        (20.0, 1536, 1, [1, 2, 9]),    # after r0 left: are blocks 1 and 2 still cached?
    ])
    cfg = ColocatedConfig(num_instances=1, engine=EngineConfig(
        kv_capacity_tokens=5120, prefix_cache_blocks=6),
        vllm=replace(VllmConfig(), shared_vram_cache=shared))
    return [r.ttft_s for r in ColocatedSim(SIMPLE_COST, cfg).run(reqs).records]


def test_prefix_cache_lives_in_the_vram_running_requests_leave(tmp_path: Path) -> None:
    assert _prefix_run(tmp_path, shared=True)[2] == pytest.approx(1.536)
    assert _prefix_run(tmp_path, shared=False)[2] == pytest.approx(0.512)


def test_off_turns_every_behaviour_off() -> None:
    off = VllmConfig.off()
    assert (off.batch_prefills, off.chunk_overhead_s, off.shared_vram_cache) == (False, 0.0, False)
    on = VllmConfig()
    assert on.batch_prefills and on.chunk_overhead_s > 0 and on.shared_vram_cache
    assert on.max_num_batched_tokens == 131_072 and on.max_num_seqs == 256


@pytest.mark.parametrize("kwargs", [{"max_num_batched_tokens": 0}, {"max_num_seqs": 0},
                                    {"chunk_overhead_s": -0.1},
                                    {"max_seq_len_to_capture": -1},
                                    {"eager_decode_s": -0.1}])
def test_bad_settings_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ConfigError):
        VllmConfig(**kwargs)  # type: ignore[arg-type]


def test_cache_resize_evicts_down_by_policy() -> None:
    evicted: list[int] = []
    cache = BlockCache(4, "lru", on_evict=evicted.append)
    cache.access([1, 2, 3, 4])
    cache.access([1])
    cache.resize(2)
    assert evicted == [2, 3] and sorted(cache.blocks()) == [1, 4]
    cache.check_integrity()
    with pytest.raises(InvalidArgument):
        cache.resize(0)


def _preempt_run(tmp_path: Path, preempt: bool) -> tuple[ColocatedSim, list]:  # type: ignore[type-arg]
    reqs = trace_of(tmp_path, [(0.0, 400, 300, [1]), (0.1, 400, 300, [2])])
    cfg = ColocatedConfig(num_instances=1, engine=EngineConfig(kv_capacity_tokens=1000),
                          vllm=replace(VllmConfig(), preempt_recompute=preempt))
    sim = ColocatedSim(SIMPLE_COST, cfg)
    sim.loop.after_each = lambda: sim.instances[0].check_integrity()
    return sim, sim.run(reqs).records


def test_full_vram_preempts_the_newest_request_and_recomputes_it(tmp_path: Path) -> None:
    sim, (r0, r1) = _preempt_run(tmp_path, preempt=True)
    # r0 prefills 0..0.4, r1 0.4..0.8 (both prompts fit: KV is allocated on demand). After
    # 100 steps (1.8 s) the 1000-token VRAM is full: r1, the newest, is preempted with 100
    # tokens decoded. r0 finishes its 199 remaining steps at 3.79; r1 recomputes 501 tokens
    # (3.79 .. 4.291, its next token: a 2.491 s gap) and decodes the last 198 tokens.
    assert sim.num_preempted() == 1 and r1.num_preempted == 1 and r0.num_preempted == 0
    assert [r.ttft_s for r in (r0, r1)] == pytest.approx([0.4, 0.7])
    assert [r.finish_s for r in (r0, r1)] == pytest.approx([3.79, 6.271])
    # TBT: mean of the longest 30 of 299 gaps
    assert r0.tbt_s == pytest.approx((0.41 + 29 * 0.01) / 30)
    assert r1.tbt_s == pytest.approx((2.491 + 29 * 0.01) / 30)
    assert r1.prefill_gpu_s == pytest.approx(0.901)  # the recomputation costs GPU time too
    assert sim.peak_kv_share() == pytest.approx(1.0)


def test_reserving_input_and_output_never_preempts(tmp_path: Path) -> None:
    sim, (r0, r1) = _preempt_run(tmp_path, preempt=False)
    # r1's 700 reserved tokens do not fit beside r0's 700: it waits until r0 ends at 3.39
    assert sim.num_preempted() == 0
    assert [r.ttft_s for r in (r0, r1)] == pytest.approx([0.4, 3.69])
    assert [r.finish_s for r in (r0, r1)] == pytest.approx([3.39, 6.78])
    assert sim.peak_kv_share() == pytest.approx(0.7)
