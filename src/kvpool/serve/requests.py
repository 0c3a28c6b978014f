"""A parsed OpenAI request -> what the dispatcher needs: prompt ids, the output budget and the
worker's sampling object. Every check a client can fail is here, as a 4xx ApiError."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Protocol

from kvpool.serve.errors import ApiError, bad_request
from kvpool.serve.metrics import ProxyMetrics
from kvpool.serve.protocol import ChatRequest, CompletionRequest, Kind, new_id
from kvpool.serve.tokenizer import ModelTokenizer


class Proxy(Protocol):
    """What preparing a request and building its response read of the proxy
    (kvpool.serve.app.Proxy)."""

    model_name: str
    tokenizer: ModelTokenizer
    metrics: ProxyMetrics

    @property
    def max_model_len(self) -> int: ...


@dataclass(frozen=True, slots=True)
class PreparedRequest:
    kind: Kind
    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    sampling: dict[str, Any]
    stop: list[str]
    stream: bool
    include_usage: bool
    trace: bool = False
    """Return the `kvpool_trace` extension (token ids and stamps)."""


_ids = itertools.count(1)


def prepare(req: CompletionRequest | ChatRequest, kind: Kind, proxy: Proxy) -> PreparedRequest:
    if req.model != proxy.model_name:
        raise ApiError(404, f"model {req.model!r} does not exist; this proxy serves "
                       f"{proxy.model_name!r}", code="model_not_found", param="model")
    if isinstance(req, ChatRequest):
        ids = _chat_ids(req, proxy)
    else:
        ids = _completion_ids(req, proxy)
    if not ids:
        raise bad_request("the prompt is empty", param="prompt")
    limit = proxy.max_model_len
    if len(ids) >= limit:
        raise bad_request(f"the prompt is {len(ids)} tokens; this model's context is {limit} "
                          "tokens, including at least one output token", param="prompt")
    max_tokens = req.max_tokens or req.default_max_tokens() or limit - len(ids)
    if len(ids) + max_tokens > limit:
        raise bad_request(f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the "
                          f"context of {limit} tokens; lower max_tokens", param="max_tokens")
    return PreparedRequest(kind, new_id(kind, next(_ids)), ids, max_tokens,
                           req.sampling(max_tokens), req.stop_list, req.stream,
                           req.include_usage, req.kvpool_trace)


def _completion_ids(req: CompletionRequest, proxy: Proxy) -> list[int]:
    prompt = req.prompt
    if isinstance(prompt, str):
        return proxy.tokenizer.encode(prompt)
    if prompt and all(isinstance(p, str) for p in prompt):
        if len(prompt) != 1:
            raise bad_request("one prompt per request (got a list of "
                              f"{len(prompt)} strings)", param="prompt")
        return proxy.tokenizer.encode(str(prompt[0]))
    ids = [int(t) for t in prompt]
    vocab = proxy.tokenizer.vocab_size
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise bad_request(f"token ids {bad[:5]} are outside the vocabulary (0..{vocab - 1})",
                          param="prompt")
    return ids


def _chat_ids(req: ChatRequest, proxy: Proxy) -> list[int]:
    from jinja2.exceptions import TemplateError

    messages = [{"role": m.role, "content": m.text()} for m in req.messages]
    try:
        return proxy.tokenizer.encode_chat(messages)
    except TemplateError as exc:
        raise bad_request(f"the chat template refused the messages: {exc}",
                          param="messages") from None
