"""vLLM's `/v1/completions` as the vllm backend speaks it: request bodies built from a leg's
typed message, replies and stream chunks read back into tokens. Sans-I/O.

Every request sends the prompt as token ids (the proxy tokenized it) and asks for the output as
token ids (`return_token_ids`; logprobs keyed `token_id:N` with `return_tokens_as_token_ids`),
so no text crosses and the proxy's detokenizer, stop strings and logprobs apply unchanged.

P/D, as vLLM's own disaggregation proxies drive it:

    prefill instance  max_tokens 1, stream false,
                      kv_transfer_params {"do_remote_decode": true, "do_remote_prefill": false,
                                          "remote_engine_id": null, "remote_block_ids": null,
                                          "remote_host": null, "remote_port": null}
                      -> the reply's top-level kv_transfer_params (NIXL: do_remote_prefill,
                         remote_engine_id, remote_block_ids, remote_request_id, remote_host,
                         remote_port, tp_size), relayed as they are
    decode instance   the whole request with those kv_transfer_params; it makes every output
                      token, the first included, from the KV it pulls
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from kvpool.engine.config import SamplingParams
from kvpool.engine.sequence import TokenLogprob
from kvpool.engine.worker.messages import PlainFrame

COMPLETIONS = "/v1/completions"

PREFILL_KV_PARAMS: dict[str, Any] = {
    "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
    "remote_block_ids": None, "remote_host": None, "remote_port": None}
"""What a prefill instance is sent so that it keeps the KV for a remote decode."""
TOKEN_ID_PREFIX = "token_id:"
NO_TOKEN_IDS = ("the reply carries text but no token_ids: the instance is a vLLM without "
                "return_token_ids (0.10.2 or later is needed)")


class ReplyError(ValueError):
    """A reply or chunk that is not what vLLM sends (or an error it sends); the message says
    which."""


def completion_body(model: str, prompt_ids: list[int], sampling: SamplingParams, *,
                    max_tokens: int, stream: bool,
                    kv_transfer_params: dict[str, Any] | None) -> dict[str, Any]:
    s = sampling
    body: dict[str, Any] = {
        "model": model, "prompt": prompt_ids, "max_tokens": max_tokens, "stream": stream,
        "temperature": s.temperature, "top_p": s.top_p, "return_token_ids": True,
        "ignore_eos": s.ignore_eos, "min_tokens": min(s.min_tokens, max_tokens),
        "skip_special_tokens": False}
    optional = {"top_k": s.top_k or None, "seed": s.seed,
                "stop_token_ids": list(s.stop_token_ids) or None,
                "presence_penalty": s.presence_penalty or None,
                "frequency_penalty": s.frequency_penalty or None,
                "repetition_penalty": None if s.repetition_penalty == 1.0 else s.repetition_penalty,
                "logit_bias": {str(k): v for k, v in s.logit_bias.items()} or None,
                "cache_salt": s.cache_salt, "kv_transfer_params": kv_transfer_params}
    body.update({k: v for k, v in optional.items() if v is not None})
    if s.logprobs is not None:
        body.update(logprobs=s.logprobs, return_tokens_as_token_ids=True)
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


@dataclass(slots=True)
class ChoiceDelta:
    """What one reply (or stream chunk) adds: tokens, their logprobs, the end."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob | None] = field(default_factory=list)
    finish_reason: str | None = None
    num_cached_tokens: int | None = None
    """Prompt tokens the instance did not compute (usage.prompt_tokens_details), if told."""
    kv_transfer_params: dict[str, Any] | None = None


def _token_id(name: str) -> int:
    if not name.startswith(TOKEN_ID_PREFIX):
        raise ReplyError(f"logprob token {name!r} is not {TOKEN_ID_PREFIX}N")
    return int(name[len(TOKEN_ID_PREFIX):])


def _logprobs(obj: Any, token_ids: list[int], k: int | None) -> list[TokenLogprob | None]:
    if k is None or not isinstance(obj, dict):
        return [None] * len(token_ids)
    values = obj.get("token_logprobs") or []
    tops = obj.get("top_logprobs") or []
    out: list[TokenLogprob | None] = []
    for i, tok in enumerate(token_ids):
        top = tops[i] if i < len(tops) and isinstance(tops[i], dict) else {}
        ranked = sorted(((_token_id(n), float(v)) for n, v in top.items()),
                        key=lambda t: (-t[1], t[0]))[:k]
        lp = values[i] if i < len(values) and values[i] is not None else float("-inf")
        out.append(TokenLogprob(tok, float(lp), tuple(ranked)))
    return out


def read_choice(obj: Any, logprobs_k: int | None) -> ChoiceDelta:
    """One completion reply or stream chunk (decoded JSON). ReplyError for an error object or
    a shape vLLM does not send."""
    if not isinstance(obj, dict):
        raise ReplyError(f"not a JSON object: {obj!r:.200}")
    if "error" in obj or obj.get("object") == "error":
        err = obj.get("error", obj)
        raise ReplyError(str(err.get("message") if isinstance(err, dict) else err))
    delta = ChoiceDelta(kv_transfer_params=obj.get("kv_transfer_params"))
    usage = obj.get("usage")
    if isinstance(usage, dict):
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and details.get("cached_tokens") is not None:
            delta.num_cached_tokens = int(details["cached_tokens"])
    choices = obj.get("choices")
    if not isinstance(choices, list):
        raise ReplyError(f"no choices in {json.dumps(obj)[:200]}")
    if not choices:
        return delta  # the usage chunk
    choice = choices[0]
    ids = choice.get("token_ids")
    if ids is None and choice.get("text"):
        raise ReplyError(NO_TOKEN_IDS)
    delta.token_ids = [int(t) for t in ids or ()]
    delta.logprobs = _logprobs(choice.get("logprobs"), delta.token_ids, logprobs_k)
    delta.finish_reason = choice.get("finish_reason")
    return delta


class _Details(msgspec.Struct):
    cached_tokens: int | None = None


class _Usage(msgspec.Struct):
    prompt_tokens_details: _Details | None = None


class _Choice(msgspec.Struct):
    token_ids: list[int] | None = None
    text: str | None = None
    finish_reason: str | None = None


class _Chunk(msgspec.Struct):
    """The fields of a stream chunk read without logprobs (the rest is skipped unread)."""

    choices: list[_Choice] | None = None
    usage: _Usage | None = None
    kv_transfer_params: dict[str, Any] | None = None
    error: Any = None
    object: str | None = None


_CHUNK = msgspec.json.Decoder(_Chunk)


def stream_delta(line: str | bytes, logprobs_k: int | None) -> ChoiceDelta | None:
    """What one line of a stream adds; None for lines that are not a `data:` chunk and for
    `[DONE]`. Without logprobs the chunk is decoded into typed fields alone (msgspec: about
    a tenth of json.loads and read_choice's time); a chunk that does not fit them, an error
    and one with logprobs are read by `read_choice`, with its errors."""
    raw = line.encode() if isinstance(line, str) else line
    if not raw.startswith(b"data:"):
        return None
    data = raw[5:].strip()
    if data == b"[DONE]":
        return None
    if logprobs_k is None:
        try:
            chunk = _CHUNK.decode(data)
        except msgspec.DecodeError:  # ValidationError included: read_choice names it
            chunk = None
        if chunk is not None and chunk.error is None and chunk.object != "error" and \
                chunk.choices is not None and len(chunk.choices) <= 1:
            return _delta(chunk)
    return read_choice(sse_data(raw.decode("utf-8", "replace")), logprobs_k)


def _delta(chunk: _Chunk) -> ChoiceDelta:
    details = chunk.usage.prompt_tokens_details if chunk.usage is not None else None
    delta = ChoiceDelta(num_cached_tokens=None if details is None else details.cached_tokens,
                        kv_transfer_params=chunk.kv_transfer_params)
    if not chunk.choices:
        return delta  # the usage chunk
    choice = chunk.choices[0]
    if choice.token_ids is None and choice.text:
        raise ReplyError(NO_TOKEN_IDS)
    delta.token_ids = choice.token_ids or []
    delta.logprobs = [None] * len(delta.token_ids)
    delta.finish_reason = choice.finish_reason
    return delta


def sse_data(line: str) -> Any | None:
    """The JSON of one `data:` line of a stream; None for other lines and for `[DONE]`."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if data == "[DONE]":
        return None
    try:
        return json.loads(data)
    except ValueError:
        raise ReplyError(f"malformed stream line {line[:200]!r}") from None


def token_chunks(lines: Sequence[bytes]) -> tuple[int, PlainFrame | None]:
    """How many of `lines` are, from the first, chunks of tokens alone (or lines without a
    chunk: `[DONE]`, comments), and their tokens as one frame (None: none). A chunk that ends
    the stream or says more (a finish reason, the usage, handoff parameters, an error, a line
    it cannot read) ends them: the vllm backend's relay in the read callback takes these."""
    ids: list[int] = []
    count = len(lines)
    for i, raw in enumerate(lines):
        try:
            delta = stream_delta(raw, None)
        except ReplyError:
            count = i
            break
        if delta is None:
            continue
        if delta.finish_reason is not None or delta.num_cached_tokens is not None \
                or delta.kv_transfer_params is not None:
            count = i
            break
        ids += delta.token_ids
    return count, PlainFrame(ids, [time.monotonic()] * len(ids)) if ids else None
