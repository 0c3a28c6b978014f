"""The emulated engine offline: profiles (round trip, errors naming the field), the step-time
arithmetic against hand-computed values, outputs equal to the tokens' expected function in
every scheduling mode, a wrong KV byte changing the output, and the block-event log."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from kvpool.clock import VirtualClock
from kvpool.conductor.cost import CostModel
from kvpool.engine.block_manager import BlockManager
from kvpool.engine.config import EngineConfig, SamplingParams
from kvpool.engine.emulated import kvbytes
from kvpool.engine.emulated.cache import ByteKVCache
from kvpool.engine.emulated.engine import EmulatedEngine
from kvpool.engine.emulated.kvbytes import ordinary_vocab
from kvpool.engine.emulated.profile import EngineProfile, load_profile, write_profile
from kvpool.engine.emulated.step_cost import PromptChunk, StepWork, step_s
from kvpool.errors import ConfigError

PROFILE = load_profile("llama70b-8xa800")


def engine(clock: VirtualClock | None = None, **kw: object) -> EmulatedEngine:
    cfg = EngineConfig(block_size=16, num_blocks=kw.pop("num_blocks", 64),  # type: ignore[arg-type]
                       max_prefill_chunk=64, max_model_len=1024, **kw)  # type: ignore[arg-type]
    return EmulatedEngine(PROFILE, cfg, ordinary_vocab(512), root_hash=12345,
                          clock=clock or VirtualClock())


PROMPTS = [[20 + i % 50 for i in range(100)], [30 + i % 40 for i in range(37)],
           [20 + i % 50 for i in range(100)] + [99] * 5]


def test_the_shipped_profile_is_the_conductors_default_cost_model() -> None:
    assert PROFILE.cost == CostModel()


def test_a_profile_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    write_profile(PROFILE, path)
    assert load_profile(path) == PROFILE


@pytest.mark.parametrize(("data", "named"), [
    ({"name": "x", "cost": {"decode_base_s": -1}}, "decode_base_s"),
    ({"name": "x", "kv_layers": 0}, "kv_layers"),
    ({"name": "x", "chunk_overhead_s": -0.1}, "chunk_overhead_s"),
    ({"name": "x", "colour": 1}, "colour"),
    ({"cost": {}}, "name"),
    ({"name": "x", "cost": {"prefil_base_s": 1}}, "prefil_base_s"),
])
def test_a_bad_profile_is_an_error_naming_the_field(tmp_path: Path, data: dict[str, object],
                                                    named: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=named):
        load_profile(path)


def test_a_profile_that_does_not_parse_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "broken.json"
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="broken.json"):
        load_profile(path)
    with pytest.raises(ConfigError, match="neither a file nor a shipped profile"):
        load_profile("no-such-profile")


def test_step_times_by_hand() -> None:
    c = CostModel()
    p = EngineProfile("hand", c, chunk_overhead_s=0.02)
    rules = p.step_rules("chunked")
    whole = c.prefill_base_s + c.prefill_linear_s * 1000 + c.prefill_quadratic_s * 1000**2
    assert step_s(c, rules, StepWork((PromptChunk(0, 1000, True),))) == pytest.approx(whole)
    # a prompt with a 4000-token prefix: compute on the rest, overlapped with loading it
    rest = c.prefill_base_s + c.prefill_linear_s * 1000 + c.prefill_quadratic_s * (5000**2 - 4000**2)
    assert step_s(c, rules, StepWork((PromptChunk(4000, 1000, True),))) == pytest.approx(
        max(rest, 4000 * c.load_s_per_token))
    later = c.prefill_linear_s * 64 + c.prefill_quadratic_s * (128**2 - 64**2)  # no base again
    decode = c.decode_base_s + c.decode_per_seq_s * 3 + c.decode_per_token_s * 900
    # one pass: the weights are read once, under the chunk's compute or the decode's
    mixed = max(later, c.decode_base_s) + decode - c.decode_base_s + 0.02
    assert step_s(c, rules, StepWork((PromptChunk(64, 64, False),), 3, 900)) == pytest.approx(mixed)
    assert step_s(c, rules, StepWork((), 3, 900)) == pytest.approx(decode)


@pytest.mark.parametrize("kw", [{}, {"prefill_mode": "whole"}, {"enable_prefix_caching": False},
                                {"max_prefill_seqs": 1}, {"num_blocks": 12}])
def test_outputs_are_the_prompts_expected_function(kw: dict[str, object]) -> None:
    e = engine(**kw)
    outs = e.generate(PROMPTS, SamplingParams(max_tokens=24, ignore_eos=True))
    assert outs == [e.expected_output(p, 24) for p in PROMPTS]
    e.blocks.check_integrity()
    assert e.blocks.num_free_blocks == e.config.num_blocks


def test_a_batch_of_many_sequences_gives_each_its_expected_output() -> None:
    """Twelve sequences decoding together (a step's tokens made through arrays,
    kvbytes.NUMPY_FROM) and prompts of their own: each output is its prompt's function."""
    e = engine(num_blocks=256)
    prompts = [[20 + (i * 13 + j * 7) % 400 for j in range(10 + 3 * i)] for i in range(12)]
    outs = e.generate(prompts, SamplingParams(max_tokens=20, ignore_eos=True))
    assert len(prompts) >= kvbytes.NUMPY_FROM
    assert outs == [e.expected_output(p, 20) for p in prompts]


def test_a_steps_next_tokens_are_each_sequences_own() -> None:
    """next_tokens (ints below NUMPY_FROM sequences, arrays from it) == output_tokens of one
    token each, for digests across the whole 64-bit range."""
    import random

    rng, vocab = random.Random(4), ordinary_vocab(512)
    for size in range(1, 3 * kvbytes.NUMPY_FROM):
        digests = [rng.choice([0, 2**64 - 1, rng.getrandbits(64)]) for _ in range(size)]
        positions = [rng.randrange(5000) for _ in range(size)]
        want = [kvbytes.output_tokens(d, j, 1, vocab)[0] for d, j in zip(digests, positions,
                                                                        strict=True)]
        assert kvbytes.next_tokens(digests, positions, vocab) == want


def test_the_scalar_mix_is_the_array_mix() -> None:
    xs = [0, 1, 2**63, 2**64 - 1, 0x9E3779B97F4A7C15, 123456789012345678]
    with np.errstate(over="ignore"):
        mixed = kvbytes.splitmix(np.array(xs, dtype=np.uint64))
    assert [kvbytes.splitmix_int(x) for x in xs] == [int(v) for v in mixed]


def test_rows_made_on_ints_are_the_rows_made_on_arrays() -> None:
    """token_rows below INT_WORDS (Python ints) == the same keys' rows among many (arrays), for
    keys across the whole 64-bit range and rows of several widths."""
    import random

    rng = random.Random(9)
    for row_bytes in (8, 16, 80):
        n = kvbytes.INT_WORDS // (row_bytes // 8) + 3  # past INT_WORDS: the arrays
        parents = [rng.choice([0, 2**64 - 1, rng.getrandbits(64)]) for _ in range(n)]
        positions = [rng.choice([0, 2**32 - 1, 2**40 + 3, rng.randrange(10**6)]) for _ in range(n)]
        tokens = [rng.randrange(2**31) for _ in range(n)]
        many = kvbytes.token_rows(np.array(parents, dtype=np.uint64),
                                  np.array(positions, dtype=np.uint64),
                                  np.array(tokens, dtype=np.uint64), row_bytes)
        assert many.shape == (n, row_bytes) and many.dtype == np.uint8
        for i in range(n):
            one = kvbytes.token_rows([parents[i]], [positions[i]], [tokens[i]], row_bytes)
            assert one.shape == (1, row_bytes) and one.dtype == np.uint8
            assert one.tobytes() == many[i].tobytes(), (row_bytes, i)


def test_decode_rows_are_the_rows_of_the_whole_sequence() -> None:
    """A decode's row (made from Python ints, batched with a prompt chunk's arrays) is the
    row the array formula gives that position, across block boundaries."""
    e = engine()
    seq = e.add_request("r", PROMPTS[1], SamplingParams(max_tokens=30, ignore_eos=True))
    e.step()
    other = e.add_request("o", PROMPTS[0], SamplingParams(max_tokens=2, ignore_eos=True))
    while seq.num_output_tokens < 25:
        e.step()
    n, bs = seq.num_computed_tokens, 16
    want = kvbytes.rows_for(seq.token_ids, 0, n, bs, seq.block_hashes, 12345, e.cache.row_bytes)
    got = np.concatenate([e.cache.rows(0, 0, seq.block_table[b // bs], min(bs, n - b))
                          for b in range(0, n, bs)])
    assert n > 48 and other.num_computed_tokens > 0
    assert np.array_equal(got ^ kvbytes.layer_constant(0, 0, e.cache.row_bytes), want)


@pytest.mark.parametrize("row", [24, 8])  # rows of several words, and of one (a flat scatter)
def test_a_steps_rows_go_to_every_layer_and_kind_and_nowhere_else(row: int) -> None:
    """ByteKVCache.write_all against an assignment per layer and kind, on bytes."""
    layers, blocks, bs = 3, 10, 4
    cache, want = ByteKVCache(layers, blocks, bs, row), ByteKVCache(layers, blocks, bs, row)
    rng = np.random.default_rng(5)
    cache.kv[:] = want.kv[:] = rng.integers(0, 256, cache.kv.shape, dtype=np.uint8)
    where = rng.choice(blocks * bs, 7, replace=False)               # distinct positions
    block_ids, offsets = (where // bs).astype(np.intp), (where % bs).astype(np.intp)
    base = rng.integers(0, 256, (7, row), dtype=np.uint8)
    constants = np.stack([kvbytes.layer_constant(layer, kind, row)
                          for layer in range(layers) for kind in (0, 1)])
    cache.write_all(block_ids, offsets, base, constants)
    for layer in range(layers):
        for kind in (0, 1):
            for i in range(7):
                want.kv[layer, block_ids[i], kind, offsets[i]] = base[i] ^ constants[2 * layer
                                                                                    + kind]
    assert np.array_equal(cache.kv, want.kv)


def test_prefix_caching_reuses_the_shared_prompt_and_whole_mode_pauses_decodes() -> None:
    e = engine()
    e.generate([PROMPTS[0]], SamplingParams(max_tokens=2, ignore_eos=True))
    seq = e.add_request("again", PROMPTS[2], SamplingParams(max_tokens=2, ignore_eos=True))
    while e.has_work:
        e.step()
    assert seq.num_cached_tokens == 96  # six full blocks of the shared 100 tokens
    w = engine(prefill_mode="whole")
    w.add_request("a", PROMPTS[0], SamplingParams(max_tokens=8, ignore_eos=True))
    w.step()  # a's prompt, whole
    w.add_request("b", PROMPTS[1], SamplingParams(max_tokens=8, ignore_eos=True))
    batch = w.scheduler.schedule(lambda s: None)
    assert [(s.request_id, n) for s, n in batch] == [("b", 37)]  # a's decode waits


def test_steps_take_the_profiles_time_on_the_clock() -> None:
    clock = VirtualClock()
    e = engine(clock, prefill_mode="whole")
    e.generate([PROMPTS[1]], SamplingParams(max_tokens=3, ignore_eos=True))
    c = PROFILE.cost
    # each decode attends over the KV it holds before the step, as the simulator counts it
    expected = (c.prefill_s(37) + c.decode_step_s(1, 37) + c.decode_step_s(1, 38))
    assert clock.now() == pytest.approx(expected, abs=1e-12)
    assert e.emulated_s == pytest.approx(expected, abs=1e-12)


def test_a_wrong_kv_byte_changes_the_output() -> None:
    e = engine()
    seq = e.add_request("r", PROMPTS[0], SamplingParams(max_tokens=4, ignore_eos=True))
    e.step()  # the first chunk (64 tokens) is in the cache now
    e.cache.kv[1, seq.block_table[0], 1, 3, 5] ^= np.uint8(1)
    while e.has_work:
        e.step()
    assert seq.output_ids != e.expected_output(PROMPTS[0], 4)


def test_the_emulated_engine_needs_no_torch() -> None:
    import subprocess

    code = ("import sys; import kvpool.engine.worker.runtime, kvpool.engine.emulated.engine; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_block_events_follow_the_hashed_set() -> None:
    bm = BlockManager(4, 2)
    assert bm.events_since(0) == [] and bm.events_since(1) is None
    e = engine(num_blocks=8)
    e.generate([PROMPTS[0][:50]], SamplingParams(max_tokens=1, ignore_eos=True))
    events = e.blocks.events_since(0)
    assert events is not None and [s for _, s in events] == [True] * 3
    assert {h for h, _ in events} == set(e.blocks.cached_hashes())
    other = [200 + i for i in range(100)]
    e.generate([other], SamplingParams(max_tokens=1, ignore_eos=True))  # reuses hashed blocks
    later = e.blocks.events_since(0) or []
    assert any(not stored for _, stored in later)
    held: set[int] = set()
    for h, stored in later:
        (held.add if stored else held.discard)(h)
    assert held == set(e.blocks.cached_hashes())
    assert e.blocks.events_since(e.blocks.num_events) == []


def test_bench_engine_writes_a_profile_of_the_real_engine(tmp_path: Path) -> None:
    """`kvpool bench engine --write-profile`: the torch engine's measured step times, in the
    form the emulated engine and the simulator read."""
    import subprocess

    from kvpool.engine.llm_engine import LLMEngine
    from kvpool.engine.tiny import make_tiny

    model = make_tiny(tmp_path / "tiny")
    out = tmp_path / "here.json"
    done = subprocess.run([sys.executable, "-m", "kvpool", "bench", "engine", "--model",
                           str(model), "--quick", "--repeats", "1", "--write-profile", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    profile = load_profile(out)
    c = profile.cost
    assert c.kv_bytes_per_token == LLMEngine.from_dir(model).cache.token_bytes
    assert c.decode_base_s + c.decode_per_seq_s + c.decode_per_token_s > 0
    assert c.prefill_base_s + c.prefill_linear_s + c.prefill_quadratic_s > 0
    assert profile.cost.prefill_s(512) < 5.0  # seconds, a tiny model on a CPU
    engine = EmulatedEngine(profile, EngineConfig(block_size=16, num_blocks=64),
                            ordinary_vocab(512), root_hash=1, kv_scale=1.0)
    assert engine.cache.token_bytes == c.kv_bytes_per_token  # full scale: the real layout size


@pytest.mark.parametrize("params", [
    SamplingParams(logprobs=0), SamplingParams(prompt_logprobs=1),
    SamplingParams(logit_bias={5: 1.0}), SamplingParams(presence_penalty=0.5),
    SamplingParams(repetition_penalty=1.1)])
def test_what_needs_logits_is_refused_not_ignored(params: SamplingParams) -> None:
    from kvpool.errors import InvalidArgument
    with pytest.raises(InvalidArgument, match="emulated engine computes no logits"):
        engine().add_request("r", PROMPTS[1], params)


def test_min_tokens_holds_off_eos() -> None:
    e = engine()
    first = e.generate([PROMPTS[1]], SamplingParams(max_tokens=1, ignore_eos=True))[0][0]
    e2 = engine()
    stopped = e2.generate([PROMPTS[1]], SamplingParams(max_tokens=6, stop_token_ids=(first,)))
    assert stopped[0] == [first]
    held = engine().generate([PROMPTS[1]], SamplingParams(max_tokens=6, min_tokens=3,
                                                          stop_token_ids=(first,)))
    assert len(held[0]) >= 3


def test_finish_reason_of_tokens_already_produced() -> None:
    """What a resumed leg answers without computing: over at a stop token past min_tokens or
    at max_tokens, the same rule as a step's."""
    e = engine()
    e.eos_ids = {7}
    s = SamplingParams(max_tokens=3, stop_token_ids=(9,))
    assert [e.finish_reason_of(s, out) for out in ([], [1], [1, 9], [7], [1, 2, 3])] == [
        None, None, "stop", "stop", "length"]
    assert e.finish_reason_of(SamplingParams(max_tokens=3, ignore_eos=True), [7]) is None
    assert e.finish_reason_of(SamplingParams(max_tokens=3, min_tokens=2,
                                             stop_token_ids=(9,)), [9, 9]) is None
    assert e.finish_reason_of(SamplingParams(max_tokens=3, min_tokens=2,
                                             stop_token_ids=(9,)), [9, 9, 9]) == "stop"


def test_a_pushed_request_pays_the_join_cost_once_as_the_simulator_does(tmp_path: Path) -> None:
    from dataclasses import replace

    from kvpool.sim.disagg import DisaggConfig
    from kvpool.sim.systems import run_disagg
    from tests.sim.conftest import SIMPLE_COST, trace_of

    cost = replace(SIMPLE_COST, decode_join_s=0.005)
    cfg = EngineConfig(block_size=16, num_blocks=64, max_prefill_chunk=64, max_model_len=1024)
    e = EmulatedEngine(replace(PROFILE, cost=cost), cfg, ordinary_vocab(512), root_hash=12345,
                       clock=VirtualClock())
    blocks = e.reserve_blocks(37)
    assert blocks is not None
    e.start_pushed("r", PROMPTS[1], 5, SamplingParams(max_tokens=3, ignore_eos=True), blocks)
    while e.scheduler.has_work:
        e.step()
    # the first token came with the KV; two decode steps here: 10 ms + the 5 ms join, 10 ms
    assert e.emulated_s == pytest.approx(0.025)
    # the simulator, same terms: 37-token prefill (37 ms), then the same two steps
    reqs = trace_of(tmp_path, [(0.0, 37, 3, [1])])
    (rec,) = run_disagg(reqs, cost, DisaggConfig(num_prefill=1, num_decode=1),
                        admission="none").records
    assert rec.finish_s - rec.first_token_s == pytest.approx(0.025)


def test_the_rest_of_a_prompt_prefilled_elsewhere_joins_as_a_decode() -> None:
    """vLLM's P/D decode leg: its prompt's blocks come in through the connector (here, the
    local cache), and the rest is a chunk in the running batch with the join's cost, not a
    prefill with its base and the prefix's load."""
    e = engine()
    e.generate([PROMPTS[0]], SamplingParams(max_tokens=2, ignore_eos=True))
    plain = e.add_request("plain", PROMPTS[2], SamplingParams(max_tokens=2, ignore_eos=True))
    work = e.step_work(e.scheduler.schedule(lambda s: None))
    assert plain.num_cached_tokens == 96
    assert work.chunks == (PromptChunk(96, 9, True),) and work.joins == 0
    e.abort("plain")
    joined = e.add_request("joined", PROMPTS[2], SamplingParams(max_tokens=2, ignore_eos=True),
                           joins_prefilled=True)
    work = e.step_work(e.scheduler.schedule(lambda s: None))
    assert joined.num_cached_tokens == 96
    assert work.chunks == (PromptChunk(96, 9, False),) and work.joins == 1
