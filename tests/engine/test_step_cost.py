"""The emulated engine is charged exactly what the simulator charges (engine/emulated/
step_cost.py): on hand-worked steps, the emulated engine's step times (its real scheduler's
batches, on a virtual clock) and the simulator's (its engines' step lengths, `seg_dt`) both
equal the number worked by hand: a prefill-only step, a mixed step in one pass, a decode-only
step, a batch of whole prompts, a prompt overlapping its prefix's load, and the join cost."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpool.clock import VirtualClock
from kvpool.conductor.cost import CostModel
from kvpool.engine.config import EngineConfig, SamplingParams
from kvpool.engine.emulated.engine import EmulatedEngine
from kvpool.engine.emulated.kvbytes import ordinary_vocab
from kvpool.engine.emulated.profile import EngineProfile, write_profile
from kvpool.engine.emulated.step_cost import PromptChunk, StepRules, StepWork, step_s
from kvpool.engine.worker.runtime import WorkerConfig, make_engine
from kvpool.errors import ConfigError
from kvpool.sim.colocated import ColocatedEngine
from kvpool.sim.engine import BatchEngine
from kvpool.sim.engine import EngineConfig as SimEngineConfig
from kvpool.sim.events import EventLoop
from kvpool.sim.record import SimRequest
from kvpool.sim.trace import TraceRequest
from kvpool.sim.vllm import VllmConfig

HAND = CostModel(prefill_base_s=0.1, prefill_linear_s=0.001, prefill_quadratic_s=1e-6,
                 decode_base_s=0.02, decode_per_seq_s=0.002, decode_per_token_s=1e-5,
                 load_s_per_token=0.002, decode_join_s=0.005)
OVERHEAD = 0.03
PROFILE = EngineProfile("hand", HAND, chunk_overhead_s=OVERHEAD)
A, B = list(range(100, 140)), list(range(200, 248))  # prompts of 40 and 48 tokens, no prefix
ONCE = SamplingParams(max_tokens=3, ignore_eos=True)

# by hand; a prompt of n tokens from scratch: 0.1 + 0.001 n + 1e-6 n^2
PREFILL_A = 0.1 + 0.040 + 0.0016                      # 0.1416
PREFILL_B = 0.1 + 0.048 + 0.002304                    # 0.150304
STEP1 = PREFILL_A + OVERHEAD                          # a's chunk alone, chunked: 0.1716
DECODE_A = 0.02 + 0.002 + 1e-5 * 40                   # a decodes over its 40 tokens: 0.0224
STEP2 = max(PREFILL_B, 0.02) + DECODE_A - 0.02 + OVERHEAD   # one pass: 0.182704
STEP3 = 0.02 + 0.002 * 2 + 1e-5 * (41 + 48)           # both decode: 0.02489
WHOLE = 0.1 + 0.040 + 0.0016 + 0.048 + 0.002304       # a and b in one step, base once: 0.191904


def emulated(prefill_mode: str, kind: str, chunk: int = 64) -> EmulatedEngine:
    cfg = EngineConfig(block_size=16, num_blocks=64, max_prefill_chunk=chunk, max_model_len=512,
                       prefill_mode=prefill_mode)
    return EmulatedEngine(PROFILE, cfg, ordinary_vocab(512), root_hash=7, clock=VirtualClock(),
                          rules=PROFILE.step_rules(prefill_mode, kind))


def steps_of(e: EmulatedEngine, n: int) -> list[float]:
    """Profile seconds of the engine's next `n` steps."""
    out = []
    for _ in range(n):
        before = e.emulated_s
        e.step()
        out.append(e.emulated_s - before)
    return out


def sim_request(rid: int, prompt: list[int], output_len: int = 3) -> SimRequest:
    return SimRequest(TraceRequest(rid, 0.0, len(prompt), output_len, ()))


def test_chunked_vllm_steps_prefill_mixed_and_decode() -> None:
    e = emulated("chunked", "vllm")
    e.add_request("a", A, ONCE)
    first = steps_of(e, 1)
    e.add_request("b", B, ONCE)
    live = first + steps_of(e, 2)
    assert live == pytest.approx([STEP1, STEP2, STEP3], abs=1e-12)

    loop = EventLoop()
    sim = ColocatedEngine(0, HAND, SimEngineConfig(chunk_tokens=64), loop, lambda sr, now: None,
                          16, VllmConfig(chunk_overhead_s=OVERHEAD))
    sim.submit_prefill(sim_request(0, A), 0.0)
    loop.at(0.05, sim.submit_prefill, sim_request(1, B), 0.05)  # arrives during a's chunk
    loop.run()
    assert sim.seg_dt[:3] == pytest.approx([STEP1, STEP2, STEP3], abs=1e-12)


def test_a_step_of_whole_prompts_pays_the_base_once() -> None:
    e = emulated("whole", "vllm", chunk=128)
    e.add_request("a", A, ONCE)
    e.add_request("b", B, ONCE)
    assert steps_of(e, 1) == pytest.approx([WHOLE], abs=1e-12)

    loop = EventLoop()
    sim = ColocatedEngine(0, HAND, SimEngineConfig(), loop, lambda sr, now: None, 16,
                          VllmConfig(chunk_overhead_s=OVERHEAD))
    sim.prefill_queue.append(sim_request(0, A))
    sim.submit_prefill(sim_request(1, B), 0.0)
    loop.run()
    assert sim.seg_dt[0] == pytest.approx(WHOLE, abs=1e-12)


def test_a_long_vllm_context_decodes_eagerly() -> None:
    rules = VllmConfig(chunk_overhead_s=OVERHEAD).step_rules(chunked=False)
    lone = 0.02 + 0.002 + 1e-5 * 9000
    assert step_s(HAND, rules, StepWork((), 1, 9000, 9000)) == pytest.approx(lone + 0.008)
    assert step_s(HAND, rules, StepWork((), 1, 8192, 8192)) == pytest.approx(
        0.02 + 0.002 + 1e-5 * 8192)  # up to 8192 tokens the CUDA graph replays
    assert step_s(HAND, StepRules(), StepWork((), 1, 9000, 9000)) == pytest.approx(lone)


def test_a_prompt_overlaps_loading_its_prefix_as_the_conductor_plans() -> None:
    e = emulated("chunked", "kvpool", chunk=128)
    prefix = list(range(300, 364))  # four full blocks
    e.generate([prefix], SamplingParams(max_tokens=1, ignore_eos=True))
    e.add_request("c", prefix + list(range(400, 416)), SamplingParams(max_tokens=1))
    # 16 new tokens after 64 cached: compute 0.1 + 0.016 + 1e-6 (80^2 - 64^2) = 0.118304,
    # under the load of the 64 tokens, 0.128: the step is the load
    assert steps_of(e, 1) == pytest.approx([0.128], abs=1e-12)
    assert HAND.prefill_with_load_s(80, 64) == pytest.approx(0.128, abs=1e-12)
    # the vLLM baseline's prefix is in VRAM: the compute alone, plus the chunk overhead
    vllm = PROFILE.step_rules("chunked", "vllm")
    assert step_s(HAND, vllm, StepWork((PromptChunk(64, 16, True),))) == pytest.approx(
        0.118304 + OVERHEAD, abs=1e-12)


def test_the_join_cost_is_charged_once_as_the_simulator_charges_it() -> None:
    e = emulated("chunked", "kvpool")
    blocks = e.reserve_blocks(37)
    assert blocks is not None
    e.start_pushed("r", list(range(37)), 5, SamplingParams(max_tokens=3, ignore_eos=True),
                   blocks)
    join = 0.02 + 0.002 + 1e-5 * 37 + 0.005           # 0.02737: its first step here joins
    after = 0.02 + 0.002 + 1e-5 * 38                  # 0.02238
    assert steps_of(e, 2) == pytest.approx([join, after], abs=1e-12)

    loop = EventLoop()
    sim = BatchEngine(0, HAND, SimEngineConfig(remote_kv=True), loop, lambda sr, now: None)
    sr = sim_request(0, list(range(37)))
    sr.first_token_s = 0.0
    sim.submit_decode(sr, 0.0)
    loop.run()
    assert sim.seg_dt == pytest.approx([join, after], abs=1e-12)


def test_unknown_step_rules_are_refused() -> None:
    with pytest.raises(ConfigError, match="vlm"):
        PROFILE.step_rules("chunked", "vlm")
    with pytest.raises(ConfigError, match="eager_decode_s"):
        StepRules(eager_decode_s=-1)


def test_a_worker_prices_its_steps_by_its_step_rules(tiny_llama: Path, tmp_path: Path) -> None:
    write_profile(PROFILE, tmp_path / "hand.json")
    expected = {"kvpool": StepRules(chunk_overhead_s=OVERHEAD),
                "vllm": VllmConfig(chunk_overhead_s=OVERHEAD).step_rules(chunked=True)}
    for kind, rules in expected.items():
        config = WorkerConfig(str(tiny_llama), engine_kind="emulated",
                              profile=str(tmp_path / "hand.json"), step_rules=kind,
                              engine=EngineConfig(block_size=16, num_blocks=8))
        engine = make_engine(config)
        assert isinstance(engine, EmulatedEngine) and engine.rules == rules
    with pytest.raises(ConfigError, match="vlm"):
        make_engine(WorkerConfig(str(tiny_llama), engine_kind="emulated",
                                 profile=str(tmp_path / "hand.json"), step_rules="vlm"))
