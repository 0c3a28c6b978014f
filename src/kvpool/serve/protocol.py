"""The OpenAI-compatible HTTP surface: request models (pydantic, at the edge only), response
and chunk builders, and SSE framing. Pure functions; the app drives them."""

from __future__ import annotations

import json
import time
from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvpool.engine.config import (
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_SALT_CHARS,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
)

SSE_DONE = b"data: [DONE]\n\n"
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
"""A seed is a 64-bit integer (signed or not), as OpenAI's and vLLM's are."""


def utf8(value: Any) -> Any:
    """`value` (a string, or a list that may hold strings) if every string is valid UTF-8; a
    lone surrogate (which JSON's \\ud800 escapes can carry) is a ValueError, a 400."""
    for s in [value] if isinstance(value, str) else value if isinstance(value, list) else []:
        if isinstance(s, str):
            try:
                s.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError("text must be valid UTF-8 (it holds a lone surrogate)") from None
    return value


_COMPACT = json.JSONEncoder(separators=(",", ":")).encode
"""json.dumps(obj, separators=(",", ":")) without a new encoder for every call."""


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + _COMPACT(obj).encode() + b"\n\n"


class StreamOptions(BaseModel):
    include_usage: bool = False


MAX_STOPS, MAX_STOP_CHARS = 16, 512
"""Stop strings per request and characters per stop string (each costs work per output token
on the proxy)."""
MAX_REPETITION_PENALTY = 100.0
"""Beyond it (or below its inverse) every seen token is as good as banned (or forced); the
bounds keep the scaled logits finite."""
MAX_CHOICES = 64
"""The most choices one request may ask for (n, times the prompts of a completion)."""

UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []),
    "function_call": (None, "none"), "parallel_tool_calls": (None,),
    "response_format": (None, {"type": "text"}), "best_of": (None, 1), "suffix": (None, ""),
    "audio": (None,), "modalities": (None, ["text"]), "prediction": (None,),
    "use_beam_search": (None, False), "guided_json": (None,), "guided_regex": (None,),
    "guided_choice": (None,), "guided_grammar": (None,), "structured_outputs": (None,),
    "prompt_logprobs": (None,), "web_search_options": (None,),
}
"""Parameters kvpool does not implement, with the values that mean "not used": any other
value is a 400 naming the parameter, never a silent 200."""


def unsupported(body: dict[str, Any]) -> str | None:
    """The first parameter of `body` that asks for something kvpool does not do."""
    return next((k for k, ok in UNSUPPORTED.items() if k in body and body[k] not in ok), None)


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)  # Infinity, NaN: a 400

    model: str
    max_tokens: int | None = Field(default=None, ge=0)
    """0: only with a completion's echo, which scores the prompt (kvpool.serve.scoring)."""
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1)
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, ge=1 / MAX_REPETITION_PENALTY,
                                      le=MAX_REPETITION_PENALTY)
    logit_bias: dict[int, float] | None = None
    """Token id (a string key in JSON) -> bias in -100..100."""
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_SALT_CHARS // 2)
    """vLLM's field: prefixes are reused (and cached_tokens counted) only among requests
    with the same salt."""
    kvpool_trace: bool = False
    """kvpool's extension for benchmarks: the last chunk (or the body) carries `kvpool_trace`,
    the output token ids with the worker's clock stamp of the step that made each
    (`trace_of`); for one choice only."""

    _utf8_stop = field_validator("stop", "cache_salt")(utf8)

    @field_validator("stop")
    @classmethod
    def _stop_caps(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"at most {MAX_STOPS} stop strings of at most {MAX_STOP_CHARS} "
                             "characters each")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias_range(cls, v: dict[int, float] | None) -> dict[int, float] | None:
        if len(v or {}) > MAX_LOGIT_BIAS:
            raise ValueError(f"takes at most {MAX_LOGIT_BIAS} entries, got {len(v or {})}")
        bad = [k for k, b in (v or {}).items() if k < 0 or not -100 <= b <= 100]
        if bad:
            raise ValueError(f"needs token ids >= 0 and biases in -100..100 (token {bad[0]})")
        return v

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> Self:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be given with stream: true")
        return self

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def output_logprobs(self) -> int | None:
        """Top alternatives per output token (None: no logprobs)."""
        return None

    def default_max_tokens(self) -> int | None:
        """The output cap when `max_tokens` names none (None: up to the context length)."""
        return None

    def max_output_tokens(self) -> int | None:
        """The output tokens the request asks for (None: up to the context length)."""
        return self.max_tokens or self.default_max_tokens()

    def sampling(self, max_tokens: int, seed: int | None,
                 cache_salt: str | None = None) -> SamplingParams:
        """The engine's parameters for one choice (`cache_salt`: the one it caches under)."""
        return SamplingParams(
            max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
            top_k=max(0, self.top_k), seed=seed, stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos, min_tokens=min(self.min_tokens, max_tokens),
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, logit_bias=dict(self.logit_bias or {}),
            logprobs=self.output_logprobs(), cache_salt=cache_salt)


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    """Return the prompt before the completion (with its logprobs, if asked)."""
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    _utf8 = field_validator("prompt")(utf8)

    def default_max_tokens(self) -> int | None:
        return 16  # OpenAI's default for /v1/completions

    def output_logprobs(self) -> int | None:
        return self.logprobs


class ContentPart(BaseModel):
    """One part of a chat message's content; only text parts are served."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: str

    _utf8 = field_validator("text")(utf8)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[ContentPart] | None = None

    _utf8 = field_validator("content")(utf8)

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(p.text for p in self.content)


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    def default_max_tokens(self) -> int | None:
        return self.max_completion_tokens  # None: up to the context length

    def max_output_tokens(self) -> int | None:
        """`max_completion_tokens` first: it replaced the deprecated `max_tokens` on chat."""
        return self.default_max_tokens() or self.max_tokens

    def output_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize body: a prompt, or chat messages rendered with the chat template."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    """For a prompt (a chat template writes its own)."""

    _utf8 = field_validator("prompt")(utf8)

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]


Kind = Literal["completion", "chat"]


def new_id(kind: Kind, request_id: int) -> str:
    return f"{'cmpl' if kind == 'completion' else 'chatcmpl'}-{request_id:x}{time.time_ns():x}"


def usage(prompt_len: int, output_len: int, cached_len: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_len, "completion_tokens": output_len,
            "total_tokens": prompt_len + output_len,
            "prompt_tokens_details": {"cached_tokens": cached_len}}


def choice_body(kind: Kind, index: int, text: str, finish: str,
                logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    """One choice of a whole (non-streamed) response."""
    if kind == "completion":
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
    return {"index": index, "message": {"role": "assistant", "content": text},
            "logprobs": logprobs, "finish_reason": finish}


def full_response(kind: Kind, rid: str, model: str, choices: list[dict[str, Any]],
                  use: dict[str, Any]) -> dict[str, Any]:
    obj = "text_completion" if kind == "completion" else "chat.completion"
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model,
            "choices": choices, "usage": use}


def chunk(kind: Kind, rid: str, model: str, text: str | None, finish: str | None,
          first: bool = False, index: int = 0,
          logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    """One streamed choice; `text` None with `first` opens a chat stream with the role."""
    if kind == "completion":
        choice: dict[str, Any] = {"index": index, "text": text or "", "logprobs": logprobs,
                                  "finish_reason": finish}
        obj = "text_completion"
    else:
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text is not None:
            delta["content"] = text
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        obj = "chat.completion.chunk"
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model,
            "choices": [choice]}


class TextChunks:
    """The SSE bytes of one streamed choice's text chunks (no logprobs, no finish reason), made
    from the chunk's own encoding split around its text: per token one `json.dumps` of the
    text instead of the whole object's (12.7 -> about 1 us on the bench machine). Equal byte
    for byte to `sse(chunk(kind, rid, model, text, None, index=index))`; `created` is read for
    every chunk, as chunk() does."""

    _MARK = "\x00kvpool-text\x00"

    def __init__(self, kind: Kind, rid: str, model: str, index: int) -> None:
        self._args = (kind, rid, model)
        self._index = index
        self._created = -1
        self._parts: tuple[bytes, bytes] | None = None

    def sse(self, text: str) -> bytes:
        created = int(time.time())
        if created != self._created:
            self._created, self._parts = created, self._split(created)
        if self._parts is None:  # the mark is not found once (never with kvpool's ids)
            obj = chunk(*self._args, text, None, index=self._index)
            return sse(obj | {"created": created})
        head, tail = self._parts
        return head + json.dumps(text).encode() + tail

    def _split(self, created: int) -> tuple[bytes, bytes] | None:
        obj = chunk(*self._args, self._MARK, None, index=self._index)
        whole = sse(obj | {"created": created})
        parts = whole.split(json.dumps(self._MARK).encode())
        return (parts[0], parts[1]) if len(parts) == 2 else None


def trace_of(received_t: float, decision_s: float, token_ids: list[int],
             token_t: list[float], recv_t: list[float], kv_bytes_moved: int) -> dict[str, Any]:
    """The `kvpool_trace` object: when the proxy received the request and how long the
    conductor took (CLOCK_MONOTONIC seconds, comparable across the processes of one host), and
    each output token's id, stamp (the end of the engine step that made it) and arrival at the
    proxy (`recv_t`), and the KV bytes the prefill leg moved (pool reads and writes, or the
    push)."""
    return {"received_t": received_t, "decision_s": decision_s, "token_ids": token_ids,
            "token_t": token_t, "recv_t": recv_t, "kv_bytes_moved": kv_bytes_moved}


def usage_chunk(kind: Kind, rid: str, model: str, use: dict[str, Any]) -> dict[str, Any]:
    obj = "text_completion" if kind == "completion" else "chat.completion.chunk"
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model,
            "choices": [], "usage": use}
