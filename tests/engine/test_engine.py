"""The engine: chunked prefill, prefix reuse, batching and sampling, against plain forwards and
transformers' generate()."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvpool.engine.checkpoint import load_model
from kvpool.engine.config import EngineConfig, SamplingParams
from kvpool.engine.llm_engine import LLMEngine
from kvpool.errors import ConfigError, InvalidArgument
from tests.engine.helpers import full_logits
from tests.support.require import require_module

transformers = require_module("transformers", "the test extra (scripts/setup.sh)")

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


def prompt(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, 500, (n,), generator=g).tolist()


def engine(model_dir: Path, **kw: int) -> LLMEngine:
    return LLMEngine.from_dir(model_dir, EngineConfig(**{"block_size": 8, "num_blocks": 64, **kw}))


def test_greedy_matches_transformers_generate(tiny_llama: Path, tiny_qwen2: Path) -> None:
    for model_dir in (tiny_llama, tiny_qwen2):
        prompts = [prompt(13, 1), prompt(30, 2), prompt(5, 3)]
        ours = engine(model_dir).generate(prompts, SamplingParams(max_tokens=12))
        hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        for p, got in zip(prompts, ours, strict=True):
            out = hf.generate(torch.tensor([p]), do_sample=False, max_new_tokens=12)
            want = out[0, len(p):].tolist()
            if 1 in want:  # transformers pads with eos after stopping
                want = want[:want.index(1) + 1]
            assert got == want


def test_chunked_prefill_equals_one_pass(tiny_llama: Path) -> None:
    p = prompt(45)
    one = engine(tiny_llama, max_prefill_chunk=512)
    chunked = engine(tiny_llama, max_prefill_chunk=7)
    assert one.generate([p], GREEDY) == chunked.generate([p], GREEDY)
    # both engines put the prompt in the same fresh blocks; the chunks' KV equals one pass's
    torch.testing.assert_close(one.cache.kv, chunked.cache.kv, atol=1e-5, rtol=1e-5)


def test_engine_logits_equal_plain_forward(tiny_llama: Path) -> None:
    model = load_model(tiny_llama)
    p = prompt(20)
    eng = LLMEngine(model, EngineConfig(block_size=8, num_blocks=16, max_prefill_chunk=6))
    out = eng.generate([p], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    ids = p + out
    want = full_logits(model, ids[:-1]).argmax(-1)[len(p) - 1:].tolist()
    assert out == want


def test_prefix_cache_reuses_blocks(tiny_llama: Path) -> None:
    eng = engine(tiny_llama)
    shared = prompt(24, 5)
    first = eng.generate([shared + [7, 8, 9]], GREEDY)
    seq = eng.add_request("again", shared + [7, 8, 9], GREEDY)
    while eng.has_work:
        eng.step()
    assert seq.num_cached_tokens == 24
    assert seq.output_ids == first[0]
    eng.blocks.check_integrity()


def test_continuous_batching_equals_one_at_a_time(tiny_llama: Path) -> None:
    prompts = [prompt(n, n) for n in (3, 17, 9, 26, 11)]
    batched = engine(tiny_llama, max_prefill_chunk=16).generate(prompts, GREEDY)
    alone = [engine(tiny_llama).generate([p], GREEDY)[0] for p in prompts]
    assert batched == alone


def test_preemption_when_the_cache_is_full(tiny_llama: Path) -> None:
    prompts = [prompt(14, n) for n in range(4)]
    small = engine(tiny_llama, num_blocks=9).generate(prompts, SamplingParams(max_tokens=20,
                                                                               ignore_eos=True))
    big = engine(tiny_llama).generate(prompts, SamplingParams(max_tokens=20, ignore_eos=True))
    assert small == big


def test_seeded_sampling_is_reproducible_in_any_batch(tiny_llama: Path) -> None:
    params = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, top_k=50, seed=123,
                            ignore_eos=True)
    p = prompt(10)
    alone = engine(tiny_llama).generate([p], params)[0]
    with_others = engine(tiny_llama).generate([prompt(7, 9), p, prompt(12, 4)], params)[1]
    assert alone == with_others
    other_seed = engine(tiny_llama).generate([p], SamplingParams(
        max_tokens=10, temperature=0.9, seed=124, ignore_eos=True))[0]
    assert other_seed != alone


def test_stop_tokens_and_max_tokens(tiny_llama: Path) -> None:
    p = prompt(10)
    free = engine(tiny_llama).generate([p], GREEDY)[0]
    stop_at = free[3]
    eng = engine(tiny_llama)
    eng.add_request("r", p, SamplingParams(max_tokens=12, stop_token_ids=(stop_at,)))
    outs = []
    while eng.has_work:
        outs += eng.step()
    tokens = [o.token_id for o in outs if o.token_id is not None]
    assert tokens == free[:free.index(stop_at) + 1]
    assert outs[-1].finish_reason == "stop"
    assert engine(tiny_llama).generate([p], SamplingParams(max_tokens=2, ignore_eos=True))[0] == free[:2]


def test_abort_frees_blocks(tiny_llama: Path) -> None:
    eng = engine(tiny_llama)
    eng.add_request("r", prompt(20), GREEDY)
    eng.step()
    with pytest.raises(InvalidArgument, match="already running"):
        eng.add_request("r", prompt(5), GREEDY)
    assert eng.abort("r")
    assert eng.blocks.num_free_blocks == 64
    eng.blocks.check_integrity()


def test_a_token_id_outside_the_vocabulary_is_refused_and_harms_no_other_request(
        tiny_llama: Path) -> None:
    """An id past the vocabulary (or negative), in a prompt or a resumed request's outputs,
    is refused when the request arrives; it used to fail the batched step, and with it
    every request the engine was running."""
    eng = engine(tiny_llama)
    vocab = eng.vocab_size
    eng.add_request("ok", prompt(20), GREEDY)
    for bad in ([1, vocab], [-3, 4]):
        with pytest.raises(InvalidArgument, match="outside the model's vocabulary"):
            eng.add_request("bad", bad, GREEDY)
    with pytest.raises(InvalidArgument, match="outside the model's vocabulary"):
        eng.add_request("bad", prompt(5), GREEDY, outputs=[vocab + 1])
    outs = []
    while eng.has_work:
        outs += eng.step()
    assert not [o for o in outs if o.error is not None]
    assert sum(1 for o in outs if o.request_id == "ok" and o.token_id is not None) == 12


def test_any_64_bit_seed_samples(tiny_llama: Path) -> None:
    """Per-position seeds are taken modulo 2^64: a seed of 10^15 (x 1,000,003 is beyond
    torch's seed range) samples, and the same seed gives the same tokens."""
    engine = LLMEngine.from_dir(tiny_llama, EngineConfig(block_size=8))
    outs = [engine.generate([[5, 6, 7]], SamplingParams(max_tokens=6, temperature=1.0,
                                                        seed=seed, ignore_eos=True))
            for seed in (10**15, 10**15, 2**64 - 1, -(2**63))]
    assert outs[0] == outs[1] and all(len(o[0]) == 6 for o in outs)
    with pytest.raises(ConfigError):
        SamplingParams(seed=2**64)


def test_a_resumed_request_continues_as_if_undisturbed(tiny_llama: Path) -> None:
    """What a migrated request relies on: a new engine given the prompt and the tokens already
    produced computes them and goes on with the same tokens, greedy or seeded (the seeded
    positions, penalties and max_tokens count the resumed tokens as output)."""
    p = prompt(40, seed=3)
    for sampling in (SamplingParams(max_tokens=12),
                     SamplingParams(max_tokens=12, temperature=0.9, seed=77,
                                    frequency_penalty=0.5)):
        whole = engine(tiny_llama).generate([p], sampling)[0]
        resumed = engine(tiny_llama)
        seq = resumed.add_request("r", p, sampling, outputs=whole[:5])
        while resumed.has_work:
            resumed.step()
        assert seq.output_ids == whole, sampling
    with pytest.raises(InvalidArgument, match="nothing to resume"):
        engine(tiny_llama).add_request("r", p, SamplingParams(max_tokens=3), outputs=[1, 2, 3])
