"""Output ids -> an OpenAI response: one JSON body, or SSE chunks ending in `[DONE]`.

Both read the same delta stream, which applies stop strings, records TBT and output tokens,
and closes the token stream (releasing the request on the workers) however it ends."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from kvpool.serve.dispatch import Run
from kvpool.serve.errors import ApiError
from kvpool.serve.protocol import (
    SSE_DONE,
    chunk,
    full_response,
    sse,
    trace_of,
    usage,
    usage_chunk,
)
from kvpool.serve.requests import PreparedRequest, Proxy
from kvpool.serve.text import TextStream
from kvpool.serve.worker_client import WorkerCallError


async def _deltas(proxy: Proxy, prep: PreparedRequest, run: Run, first: int,
                  tokens: AsyncGenerator[int], text: TextStream
                  ) -> AsyncIterator[tuple[str, str | None]]:
    """(new text, finish reason or None); the finish reason comes with the last delta."""
    m = proxy.metrics
    async with contextlib.aclosing(tokens):
        tok, last = first, time.perf_counter()
        while True:
            delta = text.push(tok)
            m.output_tokens.inc()
            if delta.stopped:
                yield delta.text, "stop"
                return
            if delta.text:
                yield delta.text, None
            try:
                tok = await anext(tokens)
            except StopAsyncIteration:
                break
            now = time.perf_counter()
            m.tbt.observe(now - last)
            last = now
    yield text.flush(), run.finish_reason or "stop"


def _usage(prep: PreparedRequest, run: Run, text: TextStream) -> dict[str, Any]:
    return usage(len(prep.prompt_ids), text.num_tokens, run.cached_len)


async def full_body(proxy: Proxy, prep: PreparedRequest, run: Run, first: int,
                    tokens: AsyncGenerator[int]) -> dict[str, Any]:
    """Raises WorkerCallError if a leg fails before the end."""
    text = TextStream(proxy.tokenizer.decode, prep.stop)
    parts: list[str] = []
    finish = "stop"
    async for piece, reason in _deltas(proxy, prep, run, first, tokens, text):
        parts.append(piece)
        finish = reason or finish
    body = full_response(prep.kind, prep.request_id, proxy.model_name, "".join(parts), finish,
                         _usage(prep, run, text))
    return body | _trace(prep, run)


def _trace(prep: PreparedRequest, run: Run) -> dict[str, Any]:
    if not prep.trace:
        return {}
    return {"kvpool_trace": trace_of(run.received_t, run.decision_s, run.token_ids, run.token_t,
                                     run.recv_t, run.kv_bytes_moved)}


async def sse_stream(proxy: Proxy, prep: PreparedRequest, run: Run, first: int,
                     tokens: AsyncGenerator[int]) -> AsyncIterator[bytes]:
    kind, rid, model = prep.kind, prep.request_id, proxy.model_name
    text = TextStream(proxy.tokenizer.decode, prep.stop)
    if kind == "chat":
        yield sse(chunk(kind, rid, model, "", None, first=True))
    try:
        async for piece, finish in _deltas(proxy, prep, run, first, tokens, text):
            if piece:
                yield sse(chunk(kind, rid, model, piece, None))
            if finish is not None:
                yield sse(chunk(kind, rid, model, None, finish))
    except WorkerCallError as exc:
        yield ApiError(502, str(exc), "worker_error", "worker_failed").sse()
        yield SSE_DONE
        return
    if prep.include_usage or prep.trace:
        yield sse(usage_chunk(kind, rid, model, _usage(prep, run, text)) | _trace(prep, run))
    yield SSE_DONE
