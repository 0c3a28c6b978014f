"""The OpenAI parameters over the live cluster, through the official `openai` client:
logprobs (completions and chat, streamed or not), echo with the prompt's logprobs, n > 1, a
list of prompts, penalties, logit_bias, min_tokens; and a 400 naming every parameter that is
not served. Logprobs are checked against plain forward passes of the same weights."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest
import torch

from kvpool.serve.launch import ServingCluster
from kvpool.serve.tokenizer import ModelTokenizer
from tests.serve.conftest import sse_events
from tests.serve.test_proxy_live import client

PROMPT = "the pool keeps every block of the prompt"


def reference_logprobs(model_dir: Path, ids: list[int]) -> torch.Tensor:
    """log-softmax [len(ids), vocab] of one plain forward pass in this process."""
    from kvpool.engine.checkpoint import load_model
    from tests.engine.helpers import full_logits

    return torch.log_softmax(full_logits(load_model(model_dir), ids).float(), dim=-1)


def test_echo_with_prompt_and_output_logprobs(cluster: ServingCluster) -> None:
    tok = ModelTokenizer(cluster.model_dir)
    ids = tok.encode(PROMPT)
    out = client(cluster.proxy_url).completions.create(
        model=cluster.model_name, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2,
        echo=True, extra_body={"ignore_eos": True})
    ch = out.choices[0]
    lp = ch.logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs
    assert len(lp.tokens) == len(ids) + 4 and lp.token_logprobs[0] is None
    output = [tok.encode(t) for t in lp.tokens[len(ids):]]
    assert ch.text.startswith(tok.decode(ids)) and len(ch.text) > len(tok.decode(ids))
    ref = reference_logprobs(cluster.model_dir, ids + [int(torch.argmax(
        reference_logprobs(cluster.model_dir, ids)[-1]))])
    for i in range(1, len(ids)):
        assert lp.token_logprobs[i] == pytest.approx(ref[i - 1, ids[i]].item(), abs=1e-4)
        top = lp.top_logprobs[i]  # the best two and the prompt's own token (keyed by text:
        assert top is not None and 1 <= len(top) <= 3  # two ids may share one)
        assert lp.tokens[i] in top
        best = [*torch.topk(ref[i - 1], 2).values.tolist(), lp.token_logprobs[i]]
        assert all(any(abs(v - b) < 1e-4 for b in best) for v in top.values()), (top, best)
    first_out = lp.token_logprobs[len(ids)]
    assert first_out == pytest.approx(ref[len(ids) - 1].max().item(), abs=1e-4)  # greedy
    assert lp.text_offset is not None and lp.text_offset[0] == 0
    assert all(b >= a for a, b in zip(lp.text_offset, lp.text_offset[1:], strict=False))
    assert output  # the output's tokens are there, as text


def test_echo_with_max_tokens_0_scores_the_prompt_without_a_completion(
        cluster: ServingCluster) -> None:
    """OpenAI's way to score a prompt (lm-eval's loglikelihood): the prompt, its logprobs
    equal to a plain forward pass, no completion token; streamed, the same pieces."""
    tok = ModelTokenizer(cluster.model_dir)
    ids = tok.encode(PROMPT)
    ref = reference_logprobs(cluster.model_dir, ids)
    out = client(cluster.proxy_url).completions.create(
        model=cluster.model_name, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    ch, use = out.choices[0], out.usage
    assert (ch.text, ch.finish_reason) == (tok.decode(ids), "length")
    assert use is not None and (use.prompt_tokens, use.completion_tokens) == (len(ids), 0)
    lp = ch.logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.tokens is not None
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None
    want = [ref[i - 1, ids[i]].item() for i in range(1, len(ids))]
    assert lp.token_logprobs[1:] == pytest.approx(want, abs=1e-4)
    body = {"model": cluster.model_name, "prompt": PROMPT, "max_tokens": 0, "echo": True,
            "logprobs": 1, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", cluster.proxy_url + "/v1/completions", json=body,
                      timeout=60) as resp:
        events = sse_events(resp)
    chunks = [e for e in events if isinstance(e, dict)]
    texts = [c["choices"][0]["text"] for c in chunks if c["choices"]]  # type: ignore[index]
    assert "".join(texts) == tok.decode(ids) and events[-1] == "[DONE]"
    assert chunks[-1]["usage"]["completion_tokens"] == 0  # type: ignore[index]
    streamed = chunks[0]["choices"][0]["logprobs"]["token_logprobs"]  # type: ignore[index]
    assert streamed == lp.token_logprobs


def test_max_tokens_0_without_echo_is_a_400_naming_it(cluster: ServingCluster) -> None:
    for path, body in (("/v1/completions", {"prompt": PROMPT}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}]})):
        reply = httpx.post(cluster.proxy_url + path, timeout=60, json={
            "model": cluster.model_name, "max_tokens": 0, **body})
        error = reply.json()["error"]
        assert reply.status_code == 400 and error["param"] == "max_tokens", reply.text
        assert "only with echo" in error["message"]


def test_a_sampled_token_is_always_among_its_top_logprobs(cluster: ServingCluster) -> None:
    """OpenAI's completions give up to `logprobs` + 1 entries a position: the most likely
    tokens and the chosen one, which sampling may take from outside them; `logprobs=0`, the
    chosen one alone."""
    for n in (0, 1):
        out = client(cluster.proxy_url).completions.create(
            model=cluster.model_name, prompt=PROMPT, max_tokens=16, temperature=2.0, seed=11,
            logprobs=n, extra_body={"ignore_eos": True})
        lp = out.choices[0].logprobs
        assert lp is not None and lp.tokens and lp.top_logprobs and lp.token_logprobs
        for token, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs,
                                      strict=True):
            assert top is not None and token in top and 1 <= len(top) <= n + 1, (token, top)
            assert chosen <= max(top.values()) + 1e-6
            if n == 0:
                assert top == {token: chosen}


def test_streamed_logprobs_equal_the_whole_body(cluster: ServingCluster) -> None:
    c = client(cluster.proxy_url)
    args = {"model": cluster.model_name, "prompt": PROMPT + " again", "max_tokens": 12,
            "temperature": 0, "logprobs": 1, "extra_body": {"ignore_eos": True}}
    whole = c.completions.create(**args)  # type: ignore[call-overload]
    chunks = [ch for ch in c.completions.create(**args, stream=True) if ch.choices]  # type: ignore[call-overload]
    streamed_tokens = [t for ch in chunks if ch.choices[0].logprobs
                       for t in ch.choices[0].logprobs.tokens or []]
    streamed_lps = [v for ch in chunks if ch.choices[0].logprobs
                    for v in ch.choices[0].logprobs.token_logprobs or []]
    assert whole.choices[0].logprobs is not None
    assert streamed_tokens == whole.choices[0].logprobs.tokens and len(streamed_tokens) == 12
    assert streamed_lps == pytest.approx(whole.choices[0].logprobs.token_logprobs, abs=1e-6)
    assert "".join(ch.choices[0].text for ch in chunks) == whole.choices[0].text


def test_chat_logprobs_streamed_or_not(cluster: ServingCluster) -> None:
    c = client(cluster.proxy_url)
    msgs = [{"role": "user", "content": "name a cache"}]
    full = c.chat.completions.create(model=cluster.model_name, messages=msgs,  # type: ignore[arg-type]
                                     max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
    content = full.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == full.usage.completion_tokens  # type: ignore[union-attr]
    assert all(len(e.top_logprobs) == 3 and e.logprob <= 0 for e in content)
    assert all(e.top_logprobs[0].logprob == pytest.approx(e.logprob) for e in content)  # greedy
    assert "".join(e.token for e in content) == full.choices[0].message.content
    chunks = [ch for ch in c.chat.completions.create(  # type: ignore[call-overload]
        model=cluster.model_name, messages=msgs, max_tokens=6, temperature=0, logprobs=True,
        top_logprobs=3, stream=True) if ch.choices]
    streamed = [e for ch in chunks if ch.choices[0].logprobs
                for e in ch.choices[0].logprobs.content or []]
    assert [e.token for e in streamed] == [e.token for e in content]
    plain = c.chat.completions.create(model=cluster.model_name, messages=msgs,  # type: ignore[arg-type]
                                      max_tokens=6, temperature=0)
    assert plain.choices[0].logprobs is None


def test_n_choices_and_prompt_lists(cluster: ServingCluster) -> None:
    c = client(cluster.proxy_url)
    sampled = c.completions.create(model=cluster.model_name, prompt=PROMPT, max_tokens=8, n=3,
                                   temperature=1.0, seed=11, extra_body={"ignore_eos": True})
    again = c.completions.create(model=cluster.model_name, prompt=PROMPT, max_tokens=8, n=3,
                                 temperature=1.0, seed=11, extra_body={"ignore_eos": True})
    assert [ch.index for ch in sampled.choices] == [0, 1, 2]
    texts = [ch.text for ch in sampled.choices]
    assert texts == [ch.text for ch in again.choices] and len(set(texts)) > 1
    one = c.completions.create(model=cluster.model_name, prompt=PROMPT, max_tokens=8,
                               temperature=1.0, seed=11, extra_body={"ignore_eos": True})
    assert one.choices[0].text == texts[0]  # choice 0 keeps the request's seed
    assert sampled.usage is not None and sampled.usage.completion_tokens == 24
    prompts = ["a cache", "the pool of blocks"]
    many = c.completions.create(model=cluster.model_name, prompt=prompts, max_tokens=5, n=2,
                                temperature=0, extra_body={"ignore_eos": True})
    alone = [c.completions.create(model=cluster.model_name, prompt=p, max_tokens=5,
                                  temperature=0, extra_body={"ignore_eos": True}).choices[0].text
             for p in prompts]
    assert [ch.text for ch in many.choices] == [alone[0], alone[0], alone[1], alone[1]]
    tok = ModelTokenizer(cluster.model_dir)
    assert many.usage is not None
    assert many.usage.prompt_tokens == sum(len(tok.encode(p)) for p in prompts)
    ids = c.completions.create(model=cluster.model_name, prompt=[tok.encode(p) for p in prompts],
                               max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    assert [ch.text for ch in ids.choices] == alone


def test_n_choices_stream_interleaved(cluster: ServingCluster) -> None:
    chunks = [ch for ch in client(cluster.proxy_url).chat.completions.create(  # type: ignore[call-overload]
        model=cluster.model_name, messages=[{"role": "user", "content": "hi"}], max_tokens=6,
        n=2, temperature=0.9, seed=5, stream=True, stream_options={"include_usage": True})]
    finishes = {ch.choices[0].index: ch.choices[0].finish_reason for ch in chunks
                if ch.choices and ch.choices[0].finish_reason}
    assert set(finishes) == {0, 1}
    roles = [ch.choices[0].index for ch in chunks if ch.choices and ch.choices[0].delta.role]
    assert sorted(roles) == [0, 1]
    assert chunks[-1].usage is not None and chunks[-1].choices == []


def test_logit_bias_penalties_and_min_tokens(cluster: ServingCluster) -> None:
    c = client(cluster.proxy_url)
    forced = c.completions.create(model=cluster.model_name, prompt=PROMPT, max_tokens=4,
                                  temperature=0, logit_bias={"42": 100},
                                  extra_body={"ignore_eos": True})
    tok = ModelTokenizer(cluster.model_dir)
    assert forced.choices[0].text == tok.decode([42] * 4)
    plain = c.completions.create(model=cluster.model_name, prompt=PROMPT, max_tokens=16,
                                 temperature=0, extra_body={"ignore_eos": True})
    penalised = c.completions.create(model=cluster.model_name, prompt=PROMPT, max_tokens=16,
                                     temperature=0, frequency_penalty=2.0, presence_penalty=2.0,
                                     extra_body={"ignore_eos": True, "repetition_penalty": 1.3})
    assert penalised.choices[0].text != plain.choices[0].text
    first = tok.encode(plain.choices[0].text)[0]
    stopped = c.completions.create(model=cluster.model_name, prompt=PROMPT, max_tokens=8,
                                   temperature=0, extra_body={"stop_token_ids": [first]})
    assert stopped.usage is not None and stopped.usage.completion_tokens == 1
    held = c.completions.create(model=cluster.model_name, prompt=PROMPT, max_tokens=8,
                                temperature=0, extra_body={"stop_token_ids": [first],
                                                           "min_tokens": 5})
    assert held.usage is not None and held.usage.completion_tokens >= 5


@pytest.mark.parametrize(("extra", "param"), [
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"best_of": 2}, "best_of"),
    ({"suffix": "the end"}, "suffix"),
    ({"logit_bias": {"99999": 1}}, "logit_bias"),
    ({"logprobs": 21}, "logprobs"),
])
def test_what_is_not_served_is_a_400_naming_it(cluster: ServingCluster, extra: dict[str, object],
                                               param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client(cluster.proxy_url).completions.create(model=cluster.model_name, prompt="x",
                                                     max_tokens=2, extra_body=extra)
    assert info.value.status_code == 400
    body = info.value.body
    assert isinstance(body, dict)
    err = body.get("error", body)
    assert err["param"] == param and param in err["message"], body


def test_chat_max_completion_tokens_wins_over_max_tokens(cluster: ServingCluster) -> None:
    """`max_completion_tokens` replaced the deprecated `max_tokens` on chat: given both, it
    decides (as OpenAI and vLLM do)."""
    r = httpx.post(cluster.proxy_url + "/v1/chat/completions", timeout=60, json={
        "model": cluster.model_name, "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2, "max_completion_tokens": 5, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
