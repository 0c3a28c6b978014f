"""The vllm backend's request bodies and the replies and stream chunks it reads."""

from __future__ import annotations

import pytest

from kvpool.engine.config import SamplingParams
from kvpool.engine.sequence import TokenLogprob
from kvpool.serve.vllm.wire import (
    PREFILL_KV_PARAMS,
    ReplyError,
    completion_body,
    read_choice,
    sse_data,
    stream_delta,
)


def test_a_prefill_body_keeps_the_kv_for_a_remote_decode() -> None:
    s = SamplingParams(max_tokens=50, min_tokens=5, seed=7, stop_token_ids=(2,), top_k=4,
                       logit_bias={3: -1.0}, cache_salt="t1")
    body = completion_body("m", [1, 2, 3], s, max_tokens=1, stream=False,
                           kv_transfer_params=dict(PREFILL_KV_PARAMS))
    assert body == {
        "model": "m", "prompt": [1, 2, 3], "max_tokens": 1, "stream": False,
        "temperature": 0.0, "top_p": 1.0, "return_token_ids": True, "ignore_eos": False,
        "min_tokens": 1, "skip_special_tokens": False, "top_k": 4, "seed": 7,
        "stop_token_ids": [2], "logit_bias": {"3": -1.0}, "cache_salt": "t1",
        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False,
                               "remote_engine_id": None, "remote_block_ids": None,
                               "remote_host": None, "remote_port": None}}


def test_a_streamed_body_asks_for_usage_and_token_id_logprobs() -> None:
    body = completion_body("m", [1], SamplingParams(logprobs=2), max_tokens=8, stream=True,
                           kv_transfer_params=None)
    assert body["stream_options"] == {"include_usage": True}
    assert body["logprobs"] == 2 and body["return_tokens_as_token_ids"] is True
    assert "kv_transfer_params" not in body and "seed" not in body


def test_a_reply_gives_tokens_cached_tokens_and_the_handoff() -> None:
    reply = {"id": "cmpl-1", "object": "text_completion",
             "choices": [{"index": 0, "text": "x", "token_ids": [42], "finish_reason": "length",
                          "logprobs": None}],
             "usage": {"prompt_tokens": 3, "completion_tokens": 1,
                       "prompt_tokens_details": {"cached_tokens": 2}},
             "kv_transfer_params": {"do_remote_prefill": True, "remote_block_ids": [1, 2]}}
    got = read_choice(reply, None)
    assert (got.token_ids, got.finish_reason, got.num_cached_tokens) == ([42], "length", 2)
    assert got.kv_transfer_params == {"do_remote_prefill": True, "remote_block_ids": [1, 2]}
    assert got.logprobs == [None]


def test_stream_chunks_with_logprobs_and_the_usage_chunk() -> None:
    chunk = {"choices": [{"index": 0, "text": "ab", "token_ids": [5, 6], "finish_reason": None,
                          "logprobs": {"tokens": ["token_id:5", "token_id:6"],
                                       "token_logprobs": [-0.5, -1.0],
                                       "top_logprobs": [{"token_id:5": -0.5, "token_id:9": -0.7,
                                                         "token_id:8": -2.0},
                                                        {"token_id:6": -1.0}]}}]}
    got = read_choice(chunk, 2)
    assert got.token_ids == [5, 6]
    assert got.logprobs == [TokenLogprob(5, -0.5, ((5, -0.5), (9, -0.7))),
                            TokenLogprob(6, -1.0, ((6, -1.0),))]
    usage = read_choice({"choices": [], "usage": {"prompt_tokens": 4}}, None)
    assert usage.token_ids == [] and usage.num_cached_tokens is None
    assert sse_data("data: [DONE]") is None and sse_data(": keep-alive") is None
    assert sse_data('data: {"a": 1}') == {"a": 1}


def test_errors_and_replies_vllm_does_not_send() -> None:
    with pytest.raises(ReplyError, match="too long"):
        read_choice({"object": "error", "message": "prompt too long", "code": 400}, None)
    with pytest.raises(ReplyError, match="return_token_ids"):
        read_choice({"choices": [{"text": "hi", "finish_reason": None}]}, None)
    with pytest.raises(ReplyError, match="malformed"):
        sse_data("data: {not json")
    with pytest.raises(ReplyError, match="not a JSON object"):
        read_choice([1], None)


CHUNKS = [
    b'data: {"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[{"index"'
    b':0,"text":" hi","logprobs":null,"finish_reason":null,"stop_reason":null,"token_ids":[7,8]'
    b'}],"usage":null}',
    b'data: {"choices":[{"index":0,"text":"","token_ids":[2],"finish_reason":"stop",'
    b'"stop_reason":2}]}',
    b'data: {"id":"cmpl-1","choices":[],"usage":{"prompt_tokens":9,"completion_tokens":3,'
    b'"prompt_tokens_details":{"cached_tokens":4}}}',
    b'data: {"choices":[],"usage":{"prompt_tokens":9,"prompt_tokens_details":null}}',
    b'data: {"choices":[{"text":"","token_ids":[]}],"kv_transfer_params":{"a":1}}',
    b'data:{"choices":[{"token_ids":[3]}]}',
]


@pytest.mark.parametrize("raw", CHUNKS)
def test_a_stream_chunk_read_fast_is_what_read_choice_reads(raw: bytes) -> None:
    for line in (raw, raw.decode()):
        assert stream_delta(line, None) == read_choice(sse_data(raw.decode()), None)


@pytest.mark.parametrize("raw,match", [
    (b'data: {"object":"error","message":"prompt too long","code":400}', "too long"),
    (b'data: {"error":{"message":"engine dead"}}', "engine dead"),
    (b'data: {"choices":[{"text":"hi","finish_reason":null}]}', "return_token_ids"),
    (b'data: {not json', "malformed"),
    (b'data: [1, 2]', "not a JSON object"),
    (b'data: {"choices":{"text":"x"}}', "no choices"),
])
def test_a_stream_chunk_that_is_an_error_or_not_vllms_is_refused(raw: bytes, match: str) -> None:
    with pytest.raises(ReplyError, match=match):
        stream_delta(raw, None)


def test_lines_other_than_data_and_the_done_line_add_nothing() -> None:
    for line in (b": keep-alive", b"", b"event: x", b"data: [DONE]", "data: [DONE]"):
        assert stream_delta(line, None) is None


def test_a_chunk_with_logprobs_is_read_with_them() -> None:
    raw = (b'data: {"choices":[{"text":"a","token_ids":[5],"logprobs":{"tokens":["token_id:5"],'
           b'"token_logprobs":[-0.5],"top_logprobs":[{"token_id:5":-0.5,"token_id:9":-0.7}]}}]}')
    got = stream_delta(raw, 1)
    assert got is not None and got.logprobs == [TokenLogprob(5, -0.5, ((5, -0.5),))]
