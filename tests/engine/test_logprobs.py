"""Logprobs, logit_bias, min_tokens and the penalties in the engine, against transformers' own
forward passes and logits processors (the independent reference)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvpool.engine.config import EngineConfig, SamplingParams
from kvpool.engine.core import StepOutput
from kvpool.engine.llm_engine import LLMEngine
from kvpool.errors import ConfigError
from tests.support.require import require_module

transformers = require_module("transformers", "the test extra (scripts/setup.sh)")


def prompt(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, 500, (n,), generator=g).tolist()


def engine(model_dir: Path, **kw: int) -> LLMEngine:
    return LLMEngine.from_dir(model_dir, EngineConfig(**{"block_size": 8, "num_blocks": 64, **kw}))


def run(eng: LLMEngine, rid: str, p: list[int], params: SamplingParams) -> list[StepOutput]:
    eng.add_request(rid, p, params)
    outs: list[StepOutput] = []
    while eng.has_work:
        outs += [o for o in eng.step() if o.request_id == rid]
    return outs


@pytest.fixture(scope="module")
def hf(tiny_llama: Path) -> object:
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)


def hf_logprobs(hf: object, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0]  # type: ignore[operator]
    return torch.log_softmax(logits.float(), dim=-1)


def test_prompt_and_output_logprobs_equal_transformers(tiny_llama: Path, hf: object) -> None:
    p = prompt(29, 1)
    params = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    # chunked prefill over several steps, and a cached prefix that must not be reused
    eng = engine(tiny_llama, max_prefill_chunk=8)
    run(eng, "warm", p[:24] + [7, 7], SamplingParams(max_tokens=1))
    outs = run(eng, "r", p, params)
    tokens = [o.token_id for o in outs if o.token_id is not None]
    full = p + tokens
    want = hf_logprobs(hf, full)
    first = outs[0]
    assert first.prompt_logprobs is not None and len(first.prompt_logprobs) == len(p)
    assert first.prompt_logprobs[0] is None
    for i, e in enumerate(first.prompt_logprobs[1:], start=1):
        assert e is not None and e.token_id == p[i]
        assert e.logprob == pytest.approx(want[i - 1, p[i]].item(), abs=1e-4)
        top = torch.topk(want[i - 1], 2)
        assert [t for t, _ in e.top] == top.indices.tolist()
    for j, o in enumerate(x for x in outs if x.token_id is not None):
        row = want[len(p) - 1 + j]
        assert o.logprob is not None and o.logprob.token_id == o.token_id
        assert o.logprob.logprob == pytest.approx(row[o.token_id].item(), abs=1e-4)
        assert o.logprob.top[0][0] == int(torch.argmax(row)) == o.token_id  # greedy
        assert len(o.logprob.top) == 3
    assert all(o.prompt_logprobs is None for o in outs[1:])


def test_repetition_penalty_matches_transformers_generate(tiny_llama: Path, hf: object) -> None:
    p = prompt(12, 2)
    ours = engine(tiny_llama).generate([p], SamplingParams(max_tokens=16, ignore_eos=True,
                                                           repetition_penalty=1.5))[0]
    out = hf.generate(torch.tensor([p]), do_sample=False, max_new_tokens=16,  # type: ignore[attr-defined]
                      min_new_tokens=16, repetition_penalty=1.5)
    assert ours == out[0, len(p):].tolist()
    plain = engine(tiny_llama).generate([p], SamplingParams(max_tokens=16, ignore_eos=True))[0]
    assert plain != ours  # the penalty changed something, or the test proves nothing


def test_presence_and_frequency_penalties_follow_their_rule(tiny_llama: Path, hf: object) -> None:
    p = prompt(10, 3)
    params = SamplingParams(max_tokens=12, ignore_eos=True, presence_penalty=1.5,
                            frequency_penalty=0.7)
    ours = engine(tiny_llama).generate([p], params)[0]
    ids, out = list(p), []
    for _ in range(12):  # the rule, step by step on transformers' logits
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1]  # type: ignore[operator]
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.numel())
        scores = logits - 0.7 * counts - 1.5 * (counts > 0)
        out.append(int(torch.argmax(scores)))
        ids.append(out[-1])
    assert ours == out


def test_logit_bias_and_min_tokens(tiny_llama: Path) -> None:
    p = prompt(9, 4)
    forced = engine(tiny_llama).generate([p], SamplingParams(
        max_tokens=5, ignore_eos=True, logit_bias={321: 100.0}))[0]
    assert forced == [321] * 5
    plain = engine(tiny_llama).generate([p], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    stop = plain[0]  # the greedy first token, made a stop token
    early = engine(tiny_llama).generate([p], SamplingParams(max_tokens=8,
                                                            stop_token_ids=(stop,)))[0]
    assert early == [stop]
    late = engine(tiny_llama).generate([p], SamplingParams(max_tokens=8, min_tokens=4,
                                                           stop_token_ids=(stop,)))[0]
    assert len(late) >= 4 and stop not in late[:4]
    with pytest.raises(ConfigError, match="min_tokens"):
        SamplingParams(max_tokens=2, min_tokens=3)
    with pytest.raises(ConfigError, match="logit_bias"):
        SamplingParams(logit_bias={5: 200.0})


def test_one_request_failing_in_the_step_fails_alone(tiny_llama: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import kvpool.engine.llm_engine as llm

    real = llm.choose

    def flaky(logits: torch.Tensor, seq: object, eos: object) -> object:
        if getattr(seq, "request_id", "") == "bad" and len(seq.output_ids) == 2:  # type: ignore[attr-defined]
            raise RuntimeError("boom")
        return real(logits, seq, eos)  # type: ignore[arg-type]
    monkeypatch.setattr(llm, "choose", flaky)
    eng = engine(tiny_llama)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    eng.add_request("good", prompt(11, 5), params)
    eng.add_request("bad", prompt(13, 6), params)
    outs: list[StepOutput] = []
    while eng.has_work:
        outs += eng.step()
    bad = [o for o in outs if o.request_id == "bad"]
    good = [o for o in outs if o.request_id == "good"]
    assert bad[-1].error is not None and "boom" in bad[-1].error
    assert len([o for o in bad if o.token_id is not None]) == 2
    assert good[-1].finish_reason == "length" and good[-1].error is None
    assert len([o for o in good if o.token_id is not None]) == 8
    assert eng.blocks.num_free_blocks == eng.config.num_blocks  # the failed one let go too


def test_readers_get_in_while_the_forward_runs(tiny_llama: Path) -> None:
    """A worker answers /load under the engine's state lock: a long forward must not hold it
    (a prefill longer than the proxy's silent_dead_s took its own worker out of rotation)."""
    import threading
    import time

    eng = engine(tiny_llama)
    started = threading.Event()
    model = eng.model

    class Slow:
        def __call__(self, *args: object) -> torch.Tensor:
            started.set()
            time.sleep(0.5)
            return model(*args)  # type: ignore[arg-type]

        def logits(self, hidden: torch.Tensor) -> torch.Tensor:
            return model.logits(hidden)
    eng.model = Slow()  # type: ignore[assignment]
    eng.add_request("r", prompt(9, 7), SamplingParams(max_tokens=1))

    def drive() -> None:
        with eng.state_lock:  # as the worker's engine loop does
            eng.step()
    t = threading.Thread(target=drive)
    t.start()
    assert started.wait(5)
    got = eng.state_lock.acquire(timeout=0.3)  # well inside the 0.5 s forward
    if got:
        eng.state_lock.release()
    t.join(5)
    assert got, "the forward held the state lock"


@pytest.mark.parametrize("field", ["stop_token_ids", "logit_bias"])
def test_list_valued_sampling_params_are_capped(field: str) -> None:
    big = tuple(range(1025)) if field == "stop_token_ids" else dict.fromkeys(range(1025), 1.0)
    with pytest.raises(ConfigError, match=f"{field} takes at most 1024 entries, got 1025"):
        SamplingParams(**{field: big})


def test_min_tokens_mask_and_bias_skip_ids_beyond_the_vocabulary(tiny_llama: Path) -> None:
    stops = (*range(100_000, 101_000), 321)
    out = engine(tiny_llama).generate([prompt(9, 4)], SamplingParams(
        max_tokens=6, min_tokens=4, stop_token_ids=stops,
        logit_bias={321: 100.0, 10**6: 1.0}))[0]
    assert out == [*out[:4], 321] and 321 not in out[:4]
