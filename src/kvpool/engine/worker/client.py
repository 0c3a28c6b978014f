"""A small synchronous client of the worker API: drive one request through a prefill and a
decode worker (or one colocated worker). Used by `kvpool generate`, the tests and the bench."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx

from kvpool.engine.config import SamplingParams
from kvpool.engine.worker.messages import (
    FinishLine,
    GenerateRequest,
    KVMode,
    KVTransfer,
    PrefillReply,
    PrefillRequest,
    TokenLine,
    TokensLine,
    generate_line,
    reply_from,
)
from kvpool.errors import WorkerCallError
from kvpool.metadata.http_serving import bearer_header


@dataclass
class Generation:
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    prefill: PrefillReply | None = None


def prefill(url: str, req: PrefillRequest, token: str | None = None,
            timeout_s: float = 120.0) -> PrefillReply:
    reply = httpx.post(f"{url}/prefill", headers=bearer_header(token), timeout=timeout_s,
                       json=req.model_dump(mode="json"))
    if reply.status_code != 200:
        raise WorkerCallError(url, "/prefill", f"{reply.status_code} {reply.text}",
                              reply.status_code)
    return reply_from(url, "/prefill", PrefillReply, reply.content)


def stream(url: str, req: GenerateRequest, token: str | None = None,
           timeout_s: float = 120.0) -> Iterator[TokenLine | FinishLine]:
    """The decode leg's lines, parsed, one per token; raises WorkerCallError on an error
    line."""
    with httpx.stream("POST", f"{url}/generate", json=req.model_dump(mode="json"),
                      headers=bearer_header(token), timeout=timeout_s) as reply:
        if reply.status_code != 200:
            raise WorkerCallError(url, "/generate",
                                  f"{reply.status_code} {reply.read().decode()}",
                                  reply.status_code)
        for line in reply.iter_lines():
            if line:
                msg = generate_line(url, line)
                yield from msg.split() if isinstance(msg, TokensLine) else [msg]


def generate(prompt: list[int], sampling: SamplingParams, *, decode_url: str,
             prefill_url: str | None = None, mode: KVMode = "pool", token: str | None = None,
             request_id: str | None = None) -> Generation:
    """prefill_url None: the decode worker computes the prompt (a colocated `both` worker)."""
    rid = request_id or uuid.uuid4().hex
    out = Generation()
    first: int | None = None
    if prefill_url is not None:
        transfer = KVTransfer(mode=mode, decode_url=decode_url if mode == "push" else None)
        out.prefill = prefill(prefill_url, PrefillRequest(
            request_id=rid, prompt_token_ids=prompt, sampling=sampling, kv_transfer=transfer),
            token)
        first = out.prefill.first_token_id
    req = GenerateRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling,
                          first_token_id=first, kv_source=mode if first is not None else "none")
    for msg in stream(decode_url, req, token):
        if isinstance(msg, TokenLine):
            out.token_ids.append(msg.token_id)
        else:
            out.finish_reason = msg.finish_reason
    return out

