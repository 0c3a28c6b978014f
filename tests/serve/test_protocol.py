"""The HTTP edge as pure functions: request validation, response shapes, SSE framing, errors."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from kvpool.engine.config import SamplingParams
from kvpool.serve import protocol
from kvpool.serve.errors import ApiError, rejected
from kvpool.serve.protocol import (
    SSE_DONE,
    ChatRequest,
    CompletionRequest,
    Kind,
    TextChunks,
    choice_body,
    chunk,
    full_response,
    sse,
    unsupported,
    usage,
    usage_chunk,
)


def test_sse_frames_one_json_object_per_event() -> None:
    assert sse({"a": 1}) == b'data: {"a":1}\n\n'
    assert SSE_DONE == b"data: [DONE]\n\n"


def test_sampling_defaults_and_worker_object() -> None:
    req = CompletionRequest.model_validate({"model": "m", "prompt": "hi", "stop": "\n",
                                            "temperature": 0, "seed": 3})
    assert req.stop_list == ["\n"] and req.default_max_tokens() == 16
    assert req.sampling(5, req.seed) == SamplingParams(max_tokens=5, temperature=0.0, seed=3)
    full = CompletionRequest.model_validate({
        "model": "m", "prompt": [[1, 2], [3]], "logprobs": 2, "echo": True, "min_tokens": 9,
        "presence_penalty": 0.5, "frequency_penalty": -1, "repetition_penalty": 1.2,
        "logit_bias": {"7": -100, "8": 2.5}, "n": 3, "top_k": 5})
    assert full.sampling(4, None) == SamplingParams(
        max_tokens=4, temperature=1.0, top_k=5, min_tokens=4, presence_penalty=0.5,
        frequency_penalty=-1, repetition_penalty=1.2, logit_bias={7: -100, 8: 2.5}, logprobs=2)
    chat = ChatRequest.model_validate({"model": "m", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
        "stream": True, "stream_options": {"include_usage": True}, "max_completion_tokens": 7})
    assert chat.messages[0].text() == "ab" and chat.include_usage
    assert chat.default_max_tokens() == 7
    assert chat.output_logprobs() is None
    lp = ChatRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "a"}],
                                     "logprobs": True, "top_logprobs": 3})
    assert lp.output_logprobs() == 3 and lp.sampling(2, None).logprobs == 3


@pytest.mark.parametrize("body", [
    {"model": "m", "prompt": "x", "max_tokens": -1},
    {"model": "m", "prompt": "x", "n": 0},
    {"model": "m", "prompt": "x", "n": 65},
    {"model": "m", "prompt": "x", "logprobs": 21},
    {"model": "m", "prompt": "x", "presence_penalty": 2.5},
    {"model": "m", "prompt": "x", "repetition_penalty": 0},
    {"model": "m", "prompt": "x", "repetition_penalty": 1e-40},
    {"model": "m", "prompt": "x", "stream_options": {"include_usage": True}},
    {"model": "m", "prompt": "x", "logit_bias": {"5": 101}},
    {"model": "m", "prompt": "x", "logit_bias": {"a": 1}},
    {"model": "m", "prompt": "x", "min_tokens": -1},
    {"model": "m", "prompt": "x", "temperature": -0.5},
    {"prompt": "x"},
])
def test_bad_completion_bodies_fail_validation(body: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate(body)


@pytest.mark.parametrize(("body", "field", "limit"), [
    ({"stop_token_ids": list(range(400_000))}, "stop_token_ids", "at most 1024"),
    ({"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias", "at most 1024"),
])
def test_list_valued_sampling_fields_are_capped(body: dict[str, object], field: str,
                                                limit: str) -> None:
    with pytest.raises(ValidationError, match=limit) as err:
        CompletionRequest.model_validate({"model": "m", "prompt": "x", **body})
    assert err.value.errors()[0]["loc"][0] == field
    ok = {k: (v[:1024] if isinstance(v, list) else dict(list(v.items())[:1024]))
          for k, v in body.items()}
    CompletionRequest.model_validate({"model": "m", "prompt": "x", **ok})


def test_chat_needs_messages() -> None:
    with pytest.raises(ValidationError):
        ChatRequest.model_validate({"model": "m", "messages": []})
    with pytest.raises(ValidationError, match="top_logprobs needs logprobs"):
        ChatRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "a"}],
                                    "top_logprobs": 2})


@pytest.mark.parametrize(("body", "name"), [
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"best_of": 3}, "best_of"),
    ({"suffix": "end"}, "suffix"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tools": [], "response_format": {"type": "text"}, "best_of": 1, "suffix": None}, None),
])
def test_unsupported_parameters_are_named(body: dict[str, object], name: str | None) -> None:
    assert unsupported(body) == name


def test_response_shapes_match_openai() -> None:
    use = usage(5, 2, 4)
    assert use == {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7,
                   "prompt_tokens_details": {"cached_tokens": 4}}
    c = full_response("completion", "cmpl-1", "m", [choice_body("completion", 0, "ab", "length")],
                      use)
    assert c["object"] == "text_completion" and c["choices"][0]["text"] == "ab"
    ch = full_response("chat", "chatcmpl-1", "m", [choice_body("chat", 1, "ab", "stop")], use)
    assert ch["choices"][0]["message"] == {"role": "assistant", "content": "ab"}
    assert ch["choices"][0]["index"] == 1
    first = chunk("chat", "x", "m", "", None, first=True)
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    end = chunk("chat", "x", "m", None, "stop")
    assert end["choices"][0]["delta"] == {} and end["choices"][0]["finish_reason"] == "stop"
    assert chunk("completion", "x", "m", None, "length")["choices"][0]["text"] == ""
    assert usage_chunk("chat", "x", "m", use)["choices"] == []


def test_rejection_is_a_429_with_retry_after() -> None:
    err = rejected("ttft", 3.2, 0.01, 2)
    assert err.status == 429 and err.headers == {"Retry-After": "2"}
    body = err.body()["error"]
    assert body["type"] == "rate_limit_exceeded" and body["code"] == "rejected_ttft"
    assert "TTFT" in body["message"]


def test_error_as_sse_event() -> None:
    raw = ApiError(502, "worker gone", "worker_error", "worker_failed").sse()
    assert raw.startswith(b"data: ") and raw.endswith(b"\n\n")
    assert json.loads(raw[6:])["error"]["message"] == "worker gone"


@pytest.mark.parametrize("body", [
    {"model": "m", "prompt": "x", "seed": 2**64},
    {"model": "m", "prompt": "x", "seed": -(2**63) - 1},
    {"model": "m", "prompt": "a\ud800"},
    {"model": "m", "prompt": ["ok", "\udfff"]},
    {"model": "m", "prompt": "x", "stop": "\ud800"},
])
def test_out_of_range_seeds_and_broken_text_are_refused(body: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate(body)
    assert CompletionRequest.model_validate({"model": "m", "prompt": "x", "seed": 2**64 - 1})


@pytest.mark.parametrize("content", [
    [{"type": "text", "text": 5}],
    [{"type": "image_url", "image_url": {"url": "http://x"}}],
    [{"text": "no type"}],
    "bad \ud800",
])
def test_chat_content_parts_are_text(content: object) -> None:
    with pytest.raises(ValidationError):
        ChatRequest.model_validate({"model": "m", "messages": [{"role": "u", "content": content}]})


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_text_chunks_equal_the_whole_chunk_byte_for_byte(
        kind: Kind, monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1000.2]
    monkeypatch.setattr(protocol.time, "time", lambda: now[0])
    texts = TextChunks(kind, 'cmpl-"x\\', "m/ü", 3)
    for text in ["", " hello", 'q"\\/', "\n\t\x00\x1f", "é ü 中 🙂", "\ud7ff", "a" * 300]:
        for t in (1000.2, 1000.9, 1001.0, 999.0):  # `created` follows the clock
            now[0] = t
            assert texts.sse(text) == sse(chunk(kind, 'cmpl-"x\\', "m/ü", text, None, index=3))


def test_text_chunks_fall_back_when_the_mark_is_in_an_id(monkeypatch: pytest.MonkeyPatch) -> None:
    texts = TextChunks("completion", "id\x00kvpool-text\x00", "m", 0)
    monkeypatch.setattr(protocol.time, "time", lambda: 5.0)
    assert texts.sse("a") == sse(chunk("completion", "id\x00kvpool-text\x00", "m", "a", None))
