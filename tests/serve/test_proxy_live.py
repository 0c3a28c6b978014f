"""The proxy over real workers: the official openai client, greedy text equal to the engine's
own, stop strings, prefix reuse, bad input, metrics. Real processes, real HTTP."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from kvpool.launch.children import stop
from kvpool.serve.launch import ServingCluster
from kvpool.serve.tokenizer import ModelTokenizer
from tests.serve.conftest import sse_events, start_proxy

PROMPT = "the cache block pool and the prefill of the prompt"


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def plain_greedy(model_dir: Path, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """The reference: greedy tokens from plain forward passes of the engine's model over the
    whole sequence (no scheduler, no KV reuse, no pool), in this process."""
    from kvpool.engine.checkpoint import load_model
    from tests.engine.helpers import full_logits

    model = load_model(model_dir)
    ids = list(prompt_ids)
    for _ in range(max_tokens):
        ids.append(int(full_logits(model, ids)[-1].argmax()))
    return ids[len(prompt_ids):]


def test_greedy_text_through_the_proxy_equals_the_engine(cluster: ServingCluster) -> None:
    tok = ModelTokenizer(cluster.model_dir)
    ids = tok.encode(PROMPT)
    want_ids = plain_greedy(cluster.model_dir, ids, 24)
    c = client(cluster.proxy_url)
    out = c.completions.create(model=cluster.model_name, prompt=PROMPT, max_tokens=24,
                               temperature=0, extra_body={"ignore_eos": True})
    assert out.choices[0].text == tok.decode(want_ids)
    assert out.choices[0].finish_reason == "length"
    assert out.usage is not None
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(ids), 24)
    stream = c.completions.create(model=cluster.model_name, prompt=ids, max_tokens=24,
                                  temperature=0, stream=True, extra_body={"ignore_eos": True},
                                  stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == tok.decode(want_ids)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 24


def test_pushed_kv_gives_the_same_text(cluster: ServingCluster) -> None:
    """A second proxy over the same workers, handing the KV over by push instead of the pool."""
    proc, url = start_proxy(cluster.model_dir, "--kv-transfer", "push",
                            "--prefill", cluster.worker_urls["prefill"][0],
                            "--decode", cluster.worker_urls["decode"][0])
    try:
        tok = ModelTokenizer(cluster.model_dir)
        prompt = PROMPT + " pushed"
        want = tok.decode(plain_greedy(cluster.model_dir, tok.encode(prompt), 16))
        out = client(url).completions.create(model=cluster.model_name, prompt=prompt,
                                             max_tokens=16, temperature=0,
                                             extra_body={"ignore_eos": True})
        assert out.choices[0].text == want
    finally:
        stop(proc)


def test_chat_streaming_and_not_agree(cluster: ServingCluster) -> None:
    c = client(cluster.proxy_url)
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    full = c.chat.completions.create(model=cluster.model_name, messages=msgs,  # type: ignore[arg-type]
                                     max_tokens=12, temperature=0)
    assert full.choices[0].message.role == "assistant"
    assert full.usage is not None and full.usage.total_tokens == (
        full.usage.prompt_tokens + full.usage.completion_tokens)
    tok = ModelTokenizer(cluster.model_dir)
    assert full.usage.prompt_tokens == len(tok.encode_chat(msgs))
    chunks = list(c.chat.completions.create(model=cluster.model_name, messages=msgs,  # type: ignore[arg-type]
                                            max_tokens=12, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason


def test_stop_string_cuts_the_text(cluster: ServingCluster) -> None:
    c = client(cluster.proxy_url)
    args = {"model": cluster.model_name, "prompt": PROMPT, "max_tokens": 24, "temperature": 0,
            "extra_body": {"ignore_eos": True}}
    text = c.completions.create(**args).choices[0].text  # type: ignore[call-overload]
    stop = text[len(text) // 2:len(text) // 2 + 3]
    cut = text[:text.index(stop)]
    out = c.completions.create(stop=[stop], **args)  # type: ignore[call-overload]
    assert (out.choices[0].text, out.choices[0].finish_reason) == (cut, "stop")
    streamed = list(c.completions.create(stop=stop, stream=True, **args))  # type: ignore[call-overload]
    assert "".join(ch.choices[0].text for ch in streamed) == cut
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_a_repeated_prefix_is_reused(cluster: ServingCluster) -> None:
    c = client(cluster.proxy_url)
    shared = " ".join(["the prefill of the prompt can read the cache block"] * 20)
    c.completions.create(model=cluster.model_name, prompt=shared + " one", max_tokens=2)
    again = c.completions.create(model=cluster.model_name, prompt=shared + " two", max_tokens=2)
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    cached = again.usage.prompt_tokens_details.cached_tokens or 0
    assert cached >= again.usage.prompt_tokens // 2
    metrics = httpx.get(cluster.proxy_url + "/metrics").text
    hits = [line for line in metrics.splitlines()
            if line.startswith("kvpool_proxy_prefix_hit_tokens_total")]
    assert hits and float(hits[0].split()[-1]) >= cached


def _holders(cluster: ServingCluster, block_hash: int) -> list[str]:
    return [u for u in cluster.worker_urls["prefill"]
            if block_hash in httpx.get(u + "/load").json()["block_hashes"]]


def test_the_conductor_sends_a_prefix_to_the_worker_that_holds_it(
        cluster: ServingCluster) -> None:
    from kvpool.engine.blocks import prefix_block_hashes

    tok = ModelTokenizer(cluster.model_dir)
    info = httpx.get(cluster.worker_urls["prefill"][0] + "/info").json()
    c = client(cluster.proxy_url)
    shared = " ".join(["when the decode will write the token to the store node"] * 8)
    c.completions.create(model=cluster.model_name, prompt=shared, max_tokens=1)
    ids = tok.encode(shared)
    last = prefix_block_hashes(ids, info["block_size"], info["model_hash"])[-1]
    holders = _holders(cluster, last)
    assert len(holders) == 1
    time.sleep(0.5)  # the proxy's next /load poll indexes the new blocks
    for n in range(3):  # Algorithm 1: the holder's TTFT is the lowest (no queue anywhere)
        prompt = f"{shared} and then {n} " + "the cache block pool " * 8
        out = c.completions.create(model=cluster.model_name, prompt=prompt, max_tokens=1)
        assert out.usage is not None and out.usage.prompt_tokens_details is not None
        assert (out.usage.prompt_tokens_details.cached_tokens or 0) >= len(ids) // 16 * 16
        longer = prefix_block_hashes(tok.encode(prompt), info["block_size"], info["model_hash"])
        assert longer[-1] != last  # new full blocks, computed on the chosen worker
        assert _holders(cluster, longer[-1]) == holders


@pytest.mark.parametrize(("body", "status", "param"), [
    (b'{"model": "tiny", "prompt": ', 400, None),
    (b'["not", "an", "object"]', 400, None),
    (json.dumps({"model": "nope", "prompt": "x"}).encode(), 404, "model"),
    (json.dumps({"model": "tiny", "prompt": "x", "max_tokens": -3}).encode(), 400, "max_tokens"),
    (json.dumps({"model": "tiny", "prompt": "x", "n": 0}).encode(), 400, "n"),
    (json.dumps({"model": "tiny", "prompt": ["a", "b"], "n": 40, "max_tokens": 1}).encode(),
     400, "n"),
    (json.dumps({"model": "tiny", "prompt": [1, 99999]}).encode(), 400, "prompt"),
    (json.dumps({"model": "tiny", "prompt": "x"}).encode(), 400, "messages"),  # to /chat
    (json.dumps({"model": "tiny", "prompt": "cache " * 3000}).encode(), 400, "prompt"),
    (json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 5000}).encode(), 400, "max_tokens"),
    (json.dumps({"model": "tiny", "prompt": "x", "seed": 2**70}).encode(), 400, "seed"),
    (json.dumps({"model": "tiny", "prompt": "a\ud800b"}).encode(), 400, "prompt"),
    (json.dumps({"model": "tiny", "prompt": "x", "stop": ["\udc00"]}).encode(), 400, "stop"),
    (json.dumps({"model": "tiny", "messages": [{"role": "user", "content": [
        {"type": "text", "text": 5}]}]}).encode(), 400, "messages"),
    (json.dumps({"model": "tiny", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}).encode(), 400, "messages"),
])
def test_bad_input_is_a_clear_4xx(cluster: ServingCluster, body: bytes, status: int,
                                  param: str | None) -> None:
    path = "/v1/chat/completions" if b'"messages"' in body or param == "messages" \
        else "/v1/completions"
    body = body.replace(b'"tiny"', json.dumps(cluster.model_name).encode())
    resp = httpx.post(cluster.proxy_url + path, content=body, timeout=30,
                      headers={"Content-Type": "application/json"})
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["message"] and err["param"] == param and err["type"] == "invalid_request_error"


def beside_a_stream(cluster: ServingCluster, max_tokens: int,
                    bodies: list[dict[str, Any] | bytes]) -> tuple[list[str], list[int]]:
    """The SSE data lines of a victim's streamed completion, and the status of each body
    posted one after another while it streams."""
    async def main() -> tuple[list[str], list[int]]:
        async with httpx.AsyncClient(base_url=cluster.proxy_url, timeout=120) as http:
            async def victim() -> list[str]:
                body = {"model": cluster.model_name, "prompt": PROMPT, "max_tokens": max_tokens,
                        "stream": True, "ignore_eos": True}
                async with http.stream("POST", "/v1/completions", json=body) as resp:
                    return [line async for line in resp.aiter_lines() if line.startswith("data")]

            async def others() -> list[int]:
                codes = []
                for body in bodies:
                    r = await (http.post("/v1/completions", content=body)
                               if isinstance(body, bytes) else
                               http.post("/v1/completions", json=body))
                    codes.append(r.status_code)
                return codes

            lines, codes = await asyncio.gather(victim(), others())
            return list(lines), codes

    return asyncio.run(main())


def test_bad_input_does_not_disturb_a_stream_in_flight(cluster: ServingCluster) -> None:
    lines, codes = beside_a_stream(cluster, 64, [b"{", b'{"model": "x", "prompt": "y"}',
                                                 b'{"prompt": 5}'])
    assert codes == [400, 404, 400]
    assert lines[-1] == "data: [DONE]" and len(lines) >= 2
    assert not any('"error"' in str(line) for line in lines)


def test_a_huge_seed_fails_nobody(cluster: ServingCluster) -> None:
    """A 64-bit seed far above the generator's per-position range samples (it used to overflow
    inside the engine step and abort every request the worker held)."""
    seeded: list[dict[str, Any] | bytes] = [
        {"model": cluster.model_name, "prompt": "hello", "max_tokens": 8, "temperature": 1.0,
         "seed": seed} for seed in (10**15, 2**64 - 1, -(2**63))]
    lines, codes = beside_a_stream(cluster, 48, seeded)
    assert codes == [200, 200, 200]
    assert lines[-1] == "data: [DONE]" and not any('"error"' in line for line in lines)
    assert any('"finish_reason":"length"' in line for line in lines)  # all 48 tokens came


def test_models_health_and_metrics(cluster: ServingCluster) -> None:
    models = client(cluster.proxy_url).models.list()
    assert [m.id for m in models.data] == [cluster.model_name]
    health = httpx.get(cluster.proxy_url + "/health").json()
    assert health["ok"] and (health["prefill"], health["decode"]) == (2, 1)
    client(cluster.proxy_url).completions.create(model=cluster.model_name, prompt="hi",
                                                 max_tokens=2)
    metrics = httpx.get(cluster.proxy_url + "/metrics").text
    for name in ("kvpool_proxy_ttft_seconds_bucket", "kvpool_proxy_tbt_seconds_bucket",
                 "kvpool_proxy_worker_up{", "kvpool_proxy_worker_cached_blocks{",
                 "kvpool_proxy_requests_total{", "kvpool_proxy_cost_prefill_term{",
                 "kvpool_proxy_loop_poll_pauses_total "):
        assert name in metrics, name
    # the first request the process served found its loop free to poll (nothing in flight,
    # no pause yet: a pause is only set while polling)
    stretches = next(line for line in metrics.splitlines()
                     if line.startswith("kvpool_proxy_loop_poll_stretches_total "))
    assert float(stretches.split()[1]) >= 1


def test_sse_framing_on_the_wire(cluster: ServingCluster) -> None:
    body = {"model": cluster.model_name, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", cluster.proxy_url + "/v1/chat/completions", json=body,
                      timeout=60) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = sse_events(resp)
    assert events[-1] == "[DONE]"
    usage = events[-2]
    assert isinstance(usage, dict) and usage["choices"] == [] and usage["usage"]
