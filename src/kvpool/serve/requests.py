"""An OpenAI request's body -> the parsed request (`parse_body`) -> what the dispatcher needs
(`prepare`): one `ChoiceJob` per choice (each prompt of a completion, n times), with its prompt
ids and the engine's sampling parameters. Every check a client can fail is here, as a 4xx
ApiError."""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from kvpool.engine.config import SamplingParams
from kvpool.log import get_logger
from kvpool.metadata.http_serving import BodyTooLarge, read_body
from kvpool.serve.errors import ApiError, bad_request, model_not_found, too_large
from kvpool.serve.metrics import ProxyMetrics
from kvpool.serve.protocol import (
    MAX_CHOICES,
    ChatMessage,
    ChatRequest,
    CompletionRequest,
    Kind,
    new_id,
    unsupported,
)
from kvpool.serve.tokenizer import ModelTokenizer

log = get_logger("serve.requests")


class Proxy(Protocol):
    """What preparing a request and building its response read of the proxy
    (kvpool.serve.app.Proxy)."""

    model_name: str
    tokenizer: ModelTokenizer
    metrics: ProxyMetrics

    @property
    def max_model_len(self) -> int: ...


SEED_STEP = 0x9E3779B97F4A7C15
"""Choice j > 0 of a seeded request samples with seed + j * SEED_STEP (mod 2^64): choice 0 keeps
the request's seed, so n = 1 is unchanged, and the n choices differ."""


@dataclass(frozen=True, slots=True)
class ChoiceJob:
    index: int
    """The choice's index in the response (prompt-major, then the n choices)."""
    prompt_index: int
    prompt_ids: list[int]
    sampling: SamplingParams


@dataclass(frozen=True, slots=True)
class PreparedRequest:
    kind: Kind
    request_id: str
    prompts: list[list[int]]
    jobs: list[ChoiceJob]
    stop: list[str]
    stream: bool
    include_usage: bool
    echo: bool = False
    """Completions: the prompt's text (and logprobs) come before the output's."""
    logprobs: int | None = None
    """Top alternatives per token in the response (None: no logprobs)."""
    trace: bool = False
    """Return the `kvpool_trace` extension (token ids and stamps)."""
    score_only: bool = False
    """echo with max_tokens 0: the prompt (and its logprobs) without a completion; each job
    runs for the one token that brings the prompt's logprobs (kvpool.serve.scoring)."""


_ids = itertools.count(1)


def prepare(req: CompletionRequest | ChatRequest, kind: Kind, proxy: Proxy,
            tenant: str | None = None) -> PreparedRequest:
    """`tenant`: the cache salt of the request's API key (None: no per-key salt)."""
    if req.model != proxy.model_name:
        raise model_not_found(req.model, proxy.model_name)
    prompts = ([chat_ids(req.messages, proxy)] if isinstance(req, ChatRequest)
               else _completion_ids(req, proxy))
    if len(prompts) * req.n > MAX_CHOICES:
        raise bad_request(f"{len(prompts)} prompts x n={req.n} choices is more than "
                          f"{MAX_CHOICES} per request", param="n")
    if req.kvpool_trace and len(prompts) * req.n > 1:
        raise bad_request("kvpool_trace needs a single choice", param="kvpool_trace")
    _check_vocab(req, proxy)
    echo = isinstance(req, CompletionRequest) and req.echo
    jobs: list[ChoiceJob] = []
    for i, ids in enumerate(prompts):
        sampling = _sampling(req, ids, proxy.max_model_len, echo, tenant)
        for j in range(req.n):  # the first choice keeps the request's seed, and its params
            jobs.append(ChoiceJob(len(jobs), i, ids, sampling if j == 0 else
                                  replace(sampling, seed=choice_seed(req.seed, j))))
    return PreparedRequest(kind, new_id(kind, next(_ids)), prompts, jobs, req.stop_list,
                           req.stream, req.include_usage, echo, req.output_logprobs(),
                           req.kvpool_trace, req.max_tokens == 0)


def choice_seed(seed: int | None, j: int) -> int | None:
    if seed is None or j == 0:
        return seed
    return (seed + j * SEED_STEP) % 2**64


def cache_salt(tenant: str | None, salt: str | None) -> str | None:
    """The salt a request caches under: its own `cache_salt`, within its tenant's if any
    (two tenants never share a salt, whatever salts they choose)."""
    if tenant is None:
        return salt
    return f"{tenant}/{salt or ''}"


def _sampling(req: CompletionRequest | ChatRequest, ids: list[int], limit: int,
              echo: bool, tenant: str | None) -> SamplingParams:
    if not ids:
        raise bad_request("the prompt is empty", param="prompt")
    if len(ids) >= limit:
        raise bad_request(f"the prompt is {len(ids)} tokens; this model's context is {limit} "
                          "tokens, including at least one output token", param="prompt")
    max_tokens = _max_tokens(req, len(ids), limit, echo)
    if len(ids) + max_tokens > limit:
        raise bad_request(f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the "
                          f"context of {limit} tokens; lower max_tokens", param="max_tokens")
    sampling = req.sampling(max_tokens, req.seed, cache_salt(tenant, req.cache_salt))
    if echo and sampling.logprobs is not None:
        sampling = replace(sampling, prompt_logprobs=sampling.logprobs)
    return sampling


def _max_tokens(req: CompletionRequest | ChatRequest, prompt_len: int, limit: int,
                echo: bool) -> int:
    """The output tokens to run: the request's, its kind's default, or up to the context;
    1 for echo with max_tokens 0 (a scored prompt: the token is dropped)."""
    if req.max_tokens == 0:
        if not echo:
            raise bad_request("max_tokens 0 is served only with echo: true on /v1/completions "
                              "(it scores the prompt)", param="max_tokens")
        return 1
    return req.max_output_tokens() or limit - prompt_len


def _check_vocab(req: CompletionRequest | ChatRequest, proxy: Proxy) -> None:
    check_token_ids(list(req.logit_bias or ()), proxy, "logit_bias")
    check_token_ids(req.stop_token_ids or [], proxy, "stop_token_ids")


def check_token_ids(ids: list[int], proxy: Proxy, param: str) -> list[int]:
    """`ids`, if every one is in the model's vocabulary; else a 400 naming `param`."""
    vocab = proxy.tokenizer.vocab_size
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise bad_request(f"{param}: token ids {bad[:5]} are outside the vocabulary "
                          f"(0..{vocab - 1})", param=param)
    return ids


MAX_CHARS_PER_TOKEN = 32
"""A text longer than this many characters per token of the context is refused before it is
tokenized: it could not fit (real tokenizers average 3-5 characters a token), and tokenizing
megabytes holds the interpreter long enough to stall every other request."""


def encode_text(text: str, proxy: Proxy, param: str, add_special_tokens: bool = True) -> list[int]:
    """`text`'s ids; a 400 naming `param`, before any tokenizing, when it is far too long."""
    limit = proxy.max_model_len * MAX_CHARS_PER_TOKEN
    if len(text) > limit:
        raise bad_request(f"{param} is {len(text)} characters: more than this model's context "
                          f"of {proxy.max_model_len} tokens could hold", param=param)
    return proxy.tokenizer.encode(text, add_special_tokens)


def _completion_ids(req: CompletionRequest, proxy: Proxy) -> list[list[int]]:
    """Each prompt's ids: a string, a list of strings, a list of ids, or a list of lists."""
    prompt = req.prompt
    if isinstance(prompt, str):
        return [encode_text(prompt, proxy, "prompt")]
    if prompt and all(isinstance(p, str) for p in prompt):
        return [encode_text(str(p), proxy, "prompt") for p in prompt]
    if prompt and all(isinstance(p, list) for p in prompt):
        return [check_token_ids(p, proxy, "prompt") for p in prompt]  # type: ignore[arg-type]
    return [check_token_ids(prompt, proxy, "prompt")]  # type: ignore[arg-type]


def chat_ids(chat: Sequence[ChatMessage], proxy: Proxy) -> list[int]:
    """The messages rendered with the chat template and tokenized; a 400 if the template
    refuses them."""
    from jinja2.exceptions import TemplateError

    messages = [{"role": m.role, "content": m.text()} for m in chat]
    try:
        return encode_text(proxy.tokenizer.render_chat(messages), proxy, "messages",
                           add_special_tokens=False)
    except TemplateError as exc:
        raise bad_request(f"the chat template refused the messages: {exc}",
                          param="messages") from None


BODY_DEADLINE_S = 30.0
"""A request body must be in within this long of its head (a 408 after)."""
M = TypeVar("M", bound=BaseModel)


async def _body(request: Any, limit: int) -> bytes:
    """The request body (http_serving.read_body): a 413 over `limit`, a 408 when it takes
    longer than BODY_DEADLINE_S to arrive."""
    try:
        return await read_body(request, limit, BODY_DEADLINE_S)
    except BodyTooLarge as exc:
        raise too_large(exc.size, exc.limit) from None
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {BODY_DEADLINE_S:g} s",
                       code="request_timeout") from None
    except ClientDisconnect:  # answered to no one, but logged and counted as any other
        raise ApiError(400, "the client went away before its body was in") from None


async def parse_body(request: Any, model: type[M], limit: int) -> M:
    """A Starlette request's JSON body as `model`: a 4xx ApiError for a body too large or too
    slow (`_body`), not JSON, not an object, naming a parameter this server does not serve, or
    not the model (naming the parameter, as OpenAI's errors do); fields it does not know are
    ignored (logged)."""
    raw = await _body(request, limit)
    try:
        obj = json.loads(raw)
    except ValueError as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise bad_request("the request body must be a JSON object")
    name = unsupported(obj)
    if name is not None:
        raise bad_request(f"'{name}' is not supported by this server (got {obj[name]!r:.100})",
                          param=name)
    ignored = sorted(set(obj) - set(model.model_fields))
    if ignored:
        log.debug("ignored request fields: %s", ", ".join(ignored))
    try:
        return model.model_validate(obj)
    except ValidationError as exc:
        err = exc.errors()[0]
        path = ".".join(str(p) for p in err["loc"])  # with pydantic's union branch tags
        # `param` names the top-level parameter, as OpenAI's errors do; the message the path
        raise bad_request(f"invalid '{path}': {err['msg']}",
                          param=str(err["loc"][0]) if err["loc"] else None) from None
