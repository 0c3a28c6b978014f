"""Property-based fuzzing of the proxy's request schema against the live session cluster
(`kvpool up`: two prefill workers, one decode worker, the pool): random mixes of valid and
invalid values for every parameter of /v1/completions and /v1/chat/completions, sent as raw
JSON bytes (lone surrogates as \\ud800 escapes, NaN and Infinity, token ids out of range,
wrong types, unknown fields, broken bodies). Every reply must be a 2xx or a 4xx in OpenAI's
error shape, never a 5xx, and a greedy victim completion sent before, during and after the
fuzzing must keep giving the same text."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpool.serve.launch import ServingCluster

VICTIM_PROMPT = "the decode worker reads the prefix from the pool"
TINY_TEMPERATURE = 1e-20
"""Below this a positive temperature would overflow the scaled logits; the sampler treats it
as greedy (the tests below pin that)."""
SETTINGS = settings(max_examples=300, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))

# ---------------------------------------------------------------- values

surrogates = st.sampled_from(["\ud800", "a\udc00b", "\udfff\ud800", "x\ud83d"])
texts = st.one_of(st.text(max_size=24), surrogates,
                  st.sampled_from(["", " ", "\x00", "\u202e\u200b", "🙂" * 5, "cache " * 40,
                                   "a" * 600]))
token_ids = st.one_of(st.integers(0, 300), st.integers(-5, -1),
                      st.sampled_from([10**9, 2**63, 10**30, 49151, 49152, 0]))
weird = st.sampled_from([None, True, False, "", "1", 1.5, -1, [], {}, {"a": 1}, [None], 10**30,
                         float("nan"), float("inf"), -float("inf")])
small_floats = st.floats(-3, 3, allow_nan=False)
floats = st.one_of(small_floats, st.sampled_from([0.0, 1.0, 2.0, 1e-30, 1e30, float("nan"),
                                                  float("inf"), -0.0]))
seeds = st.one_of(st.integers(-(2**63), 2**64 - 1), st.integers(0, 100),
                  st.sampled_from([10**30, -1, -(2**63) - 1, 2**64, 2**63]))
stops = st.one_of(texts, st.lists(texts, max_size=20), st.just(["\n", "."]))
logit_bias = st.dictionaries(st.one_of(token_ids.map(str), st.sampled_from(["abc", "1.5", "",
                                                                             "-0", " 3"])),
                             st.one_of(st.floats(-150, 150, allow_nan=False),
                                       st.sampled_from([float("nan"), 1e300])), max_size=4)


def maybe(values: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly `values`, sometimes any wrong type."""
    return st.one_of(values, values, values, weird)


COMMON: dict[str, st.SearchStrategy[Any]] = {
    "max_tokens": maybe(st.one_of(st.integers(1, 8), st.integers(-3, 0),
                                  st.sampled_from([10**30, 5000, "4", 4.0]))),
    "temperature": maybe(floats), "top_p": maybe(floats),
    "top_k": maybe(st.one_of(st.integers(-3, 50), st.sampled_from([10**6, 2**63]))),
    "n": maybe(st.one_of(st.integers(1, 3), st.integers(-1, 70))),
    "seed": maybe(seeds), "stop": maybe(stops),
    "stop_token_ids": maybe(st.lists(token_ids, max_size=4)),
    "logit_bias": maybe(logit_bias),
    "presence_penalty": maybe(floats), "frequency_penalty": maybe(floats),
    "repetition_penalty": maybe(floats), "min_tokens": maybe(st.integers(-2, 10)),
    "ignore_eos": maybe(st.booleans()),
    "stream": maybe(st.booleans()),
    "stream_options": maybe(st.fixed_dictionaries({}, optional={
        "include_usage": maybe(st.booleans())})),
    "cache_salt": maybe(texts),
    "user": maybe(texts), "best_of": maybe(st.integers(0, 3)),
    "response_format": maybe(st.sampled_from([{"type": "text"}, {"type": "json_object"}])),
    "kvpool_trace": maybe(st.booleans()),
    "an_unknown_field": maybe(texts), "__proto__": weird,
}

prompts = st.one_of(texts, st.lists(token_ids, max_size=12), st.lists(texts, max_size=3),
                    st.lists(st.lists(token_ids, max_size=5), max_size=3),
                    st.just([[]]), st.just([1, [2]]), st.just(["a", 1]))
content = st.one_of(texts, st.none(), st.lists(st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": maybe(texts)}),
    st.fixed_dictionaries({"type": st.sampled_from(["image_url", "nope", ""]),
                           "image_url": st.just({"url": "x"})})), max_size=3))
messages = st.lists(st.fixed_dictionaries(
    {"role": maybe(st.sampled_from(["user", "system", "assistant", "tool", "", "nobody"]))},
    optional={"content": maybe(content), "name": maybe(texts)}), max_size=4)


VALID: dict[str, st.SearchStrategy[Any]] = {
    "max_tokens": st.integers(1, 8),
    "temperature": st.one_of(st.just(0.0), st.floats(TINY_TEMPERATURE, 2)),
    "top_p": st.floats(0.01, 1), "top_k": st.integers(-1, 50), "n": st.integers(1, 3),
    "seed": st.integers(-(2**63), 2**64 - 1),
    "stop": st.one_of(st.text(min_size=1, max_size=8),
                      st.lists(st.text(min_size=1, max_size=8), max_size=4)),
    "stop_token_ids": st.lists(st.integers(0, 300), max_size=3),
    "logit_bias": st.dictionaries(st.integers(0, 300).map(str), st.floats(-100, 100),
                                  max_size=3),
    "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2), "min_tokens": st.integers(0, 4),
    "ignore_eos": st.booleans(), "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "cache_salt": st.text(min_size=1, max_size=16), "user": st.text(max_size=8),
    "an_unknown_field": st.text(max_size=8),
}
"""Values the proxy must serve (a 200, or a 4xx for a combination it refuses)."""
valid_prompts = st.one_of(st.text(min_size=1, max_size=40),
                          st.lists(st.integers(0, 300), min_size=1, max_size=12),
                          st.lists(st.text(min_size=1, max_size=12), min_size=1, max_size=2),
                          st.lists(st.lists(st.integers(0, 300), min_size=1, max_size=5),
                                   min_size=1, max_size=2))
valid_messages = st.lists(st.fixed_dictionaries({
    "role": st.sampled_from(["user", "system", "assistant"]),
    "content": st.one_of(st.text(max_size=24), st.lists(st.fixed_dictionaries(
        {"type": st.just("text"), "text": st.text(max_size=12)}), min_size=1, max_size=2))}),
    min_size=1, max_size=3)


def bodies(model: str, chat: bool) -> st.SearchStrategy[dict[str, Any]]:
    """Half of them valid throughout; the others with any value anywhere."""
    return st.one_of(_valid_bodies(model, chat), _any_bodies(model, chat))


def _valid_bodies(model: str, chat: bool) -> st.SearchStrategy[dict[str, Any]]:
    required = {"model": st.just(model),
                **({"messages": valid_messages} if chat else {"prompt": valid_prompts})}
    specific: dict[str, st.SearchStrategy[Any]] = (
        {"logprobs": st.booleans(), "max_completion_tokens": st.integers(1, 8)} if chat else
        {"logprobs": st.integers(0, 5), "echo": st.booleans()})
    return st.fixed_dictionaries(required, optional={**VALID, **specific}).map(_small)


def _any_bodies(model: str, chat: bool) -> st.SearchStrategy[dict[str, Any]]:
    specific: dict[str, st.SearchStrategy[Any]] = (
        {"messages": maybe(messages), "logprobs": maybe(st.booleans()),
         "top_logprobs": maybe(st.integers(-1, 25)),
         "max_completion_tokens": maybe(st.integers(-1, 8))} if chat else
        {"prompt": maybe(prompts), "logprobs": maybe(st.integers(-1, 25)),
         "echo": maybe(st.booleans()), "suffix": maybe(texts)})
    required = {"model": st.sampled_from([model] * 6 + ["nope", "", model.upper()])}
    if chat:
        required["messages"] = st.one_of(messages.filter(bool), messages, weird)
    else:
        required["prompt"] = st.one_of(prompts, prompts, weird)
    optional = {**COMMON, **specific}
    optional = {k: v for k, v in optional.items() if k not in required}
    return st.fixed_dictionaries(required, optional=optional).map(_small)


def _small(body: dict[str, Any]) -> dict[str, Any]:
    """Keeps the successful requests quick: a valid max_tokens at most 8, and one given
    whenever it is missing (the chat default is the whole context). And steers around the
    two corner cases the tests below pin (a tiny temperature, an infinite penalty), so that
    the fuzz looks for new ones."""
    t = body.get("temperature")
    if isinstance(t, float) and 0 < t < TINY_TEMPERATURE:
        body["temperature"] = 0.0
    if body.get("repetition_penalty") == float("inf"):
        body["repetition_penalty"] = 1.0
    mt = body.get("max_tokens")
    if isinstance(mt, int) and not isinstance(mt, bool) and 8 < mt < 10**6:
        body["max_tokens"] = 8
    body.setdefault("max_tokens", 4)
    return body


def wire(body: dict[str, Any], how: str) -> bytes:
    raw = json.dumps(body).encode()  # ensure_ascii: lone surrogates go as \udXXX escapes
    if how == "truncated":
        return raw[: len(raw) // 2]
    if how == "bad-utf8":
        return raw[:-1] + b"\xff\xfe}"
    if how == "list":
        return b"[" + raw + b"]"
    return raw


encodings = st.sampled_from(["json"] * 12 + ["truncated", "bad-utf8", "list"])

# ---------------------------------------------------------------- checks


def check_reply(r: httpx.Response, streamed: bool) -> None:
    assert r.status_code < 500, (r.status_code, r.text[:500])
    assert 200 <= r.status_code < 500, r.status_code
    if r.status_code >= 400:
        err = r.json()["error"]
        assert isinstance(err["message"], str) and err["message"], r.text
        assert isinstance(err["type"], str) and err["type"], r.text
        assert "Traceback" not in r.text
        return
    if streamed:
        assert r.headers["content-type"].startswith("text/event-stream"), r.headers
        lines = [line for line in r.text.splitlines() if line.startswith("data: ")]
        assert lines and lines[-1] == "data: [DONE]", r.text[-500:]
        for line in lines[:-1]:
            event = json.loads(line[6:])
            assert "error" not in event, line
    else:
        obj = r.json()
        assert obj["choices"] and obj["usage"]["prompt_tokens"] > 0, r.text[:500]


def victim_text(http: httpx.Client, model: str) -> str:
    r = http.post("/v1/completions", json={
        "model": model, "prompt": VICTIM_PROMPT, "max_tokens": 8, "temperature": 0,
        "ignore_eos": True})
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["text"])


@contextmanager
def victim_beside(url: str, model: str) -> Iterator[list[str | BaseException]]:
    """A thread sending the victim over and over until the block ends; what each gave."""
    got: list[str | BaseException] = []
    done = threading.Event()

    def loop() -> None:
        with httpx.Client(base_url=url, timeout=60) as http:
            while not done.is_set():
                try:
                    got.append(victim_text(http, model))
                except BaseException as exc:  # a failure is an outcome too
                    got.append(exc)

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    try:
        yield got
    finally:
        done.set()
        t.join(timeout=60)


def fuzz(cluster: ServingCluster, chat: bool) -> None:
    url, model = cluster.proxy_url, cluster.model_name
    path = "/v1/chat/completions" if chat else "/v1/completions"
    with httpx.Client(base_url=url, timeout=60,
                      headers={"Content-Type": "application/json"}) as http:
        want = victim_text(http, model)
        statuses: dict[int, int] = {}
        count = [0]

        @SETTINGS
        @given(body=bodies(model, chat), how=encodings)
        def one(body: dict[str, Any], how: str) -> None:
            r = http.post(path, content=wire(body, how))
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            check_reply(r, how == "json" and body.get("stream") is True
                        and r.status_code == 200)
            count[0] += 1
            if count[0] % 25 == 0:  # and interleaved with the fuzz, on the same connection
                assert victim_text(http, model) == want

        with victim_beside(url, model) as beside:
            one()
        assert victim_text(http, model) == want
        assert beside and all(v == want for v in beside), [v for v in beside if v != want][:3]
        # the fuzz reached both sides: some requests ran, some were refused
        assert statuses.get(200, 0) >= 5 and sum(n for s, n in statuses.items()
                                                 if 400 <= s < 500) >= 5, statuses
        health = http.get("/health").json()
        assert health["ok"] and (health["prefill"], health["decode"]) == (2, 1), health


@pytest.mark.slow
def test_fuzz_completions(cluster: ServingCluster) -> None:
    fuzz(cluster, chat=False)


@pytest.mark.slow
def test_fuzz_chat_completions(cluster: ServingCluster) -> None:
    fuzz(cluster, chat=True)


@pytest.mark.parametrize("body", [
    {"temperature": float("nan")}, {"top_p": float("nan")}, {"temperature": 1e-20},
    {"repetition_penalty": 1e30}, {"repetition_penalty": float("nan")},
    {"repetition_penalty": 1e-40}, {"repetition_penalty": 1e-300},
    {"presence_penalty": float("nan")}, {"logit_bias": {"1": float("nan")}},
    {"seed": 10**30}, {"seed": -(2**63) - 1}, {"top_k": 2**63}, {"stop_token_ids": [2**63]},
    {"prompt": [2**63]}, {"prompt": [-1]}, {"prompt": [[]]}, {"prompt": []},
    {"prompt": "\ud800"}, {"cache_salt": "\udc00"}, {"logprobs": 10**6},
    {"min_tokens": 10**30}, {"stop": [""]}, {"n": 10**30},
], ids=lambda b: json.dumps(b)[:40])
def test_edge_values_never_fail_the_server(cluster: ServingCluster, body: dict[str, Any]) -> None:
    """The corners the fuzz may or may not hit, each once: a 2xx or a 4xx, never a 5xx."""
    full = {"model": cluster.model_name, "prompt": "x", "max_tokens": 2, **body}
    r = httpx.post(cluster.proxy_url + "/v1/completions", content=json.dumps(full).encode(),
                   headers={"Content-Type": "application/json"}, timeout=60)
    check_reply(r, streamed=False)


def _post(cluster: ServingCluster, body: dict[str, Any]) -> httpx.Response:
    full = {"model": cluster.model_name, "prompt": "x", "max_tokens": 2, **body}
    return httpx.post(cluster.proxy_url + "/v1/completions", content=json.dumps(full).encode(),
                      headers={"Content-Type": "application/json"}, timeout=60)


@pytest.mark.parametrize("temperature", [1e-300, 5e-324, 1e-40])
def test_a_tiny_positive_temperature_is_served_or_refused(cluster: ServingCluster,
                                                          temperature: float) -> None:
    check_reply(_post(cluster, {"temperature": temperature}), streamed=False)


def test_an_infinite_repetition_penalty_is_a_400(cluster: ServingCluster) -> None:
    r = _post(cluster, {"repetition_penalty": float("inf")})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "repetition_penalty"


def test_a_failing_temperature_does_not_disturb_a_stream_in_flight(
        cluster: ServingCluster) -> None:
    """Whatever a bad request's fate, the requests batched beside it on the same workers
    finish."""
    from tests.serve.test_proxy_live import beside_a_stream

    bad: list[dict[str, Any] | bytes] = [
        {"model": cluster.model_name, "prompt": "hello", "max_tokens": 4, "temperature": t}
        for t in (1e-300, 1e-40, 5e-324)]
    lines, codes = beside_a_stream(cluster, 48, bad)
    assert all(c < 600 for c in codes)
    assert lines[-1] == "data: [DONE]" and not any('"error"' in line for line in lines)
    assert any('"finish_reason":"length"' in line for line in lines)
