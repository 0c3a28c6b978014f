"""Output ids -> an OpenAI response: one JSON body, or SSE chunks ending in `[DONE]`, over one
or more running choices (a list of prompts, `n`).

Every choice reads its own delta stream, one delta per chunk of tokens (a frame of the decode
leg: one SSE chunk for the tokens of one engine step), which applies stop strings, records TBT
and output tokens, and closes its chunk stream (releasing the request on the workers) however
it ends. With --worker-sse a streamed choice relays the chunks its decode worker made instead
(`_relayed`).
A choice that fails fails the response (a 502 body, or an SSE error event) and ends the
others."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from kvpool.errors import WorkerCallError
from kvpool.metadata.http_front import LastChunk
from kvpool.metadata.http_serving import BodyWriter
from kvpool.serve.access import Access
from kvpool.serve.cancel import cancel_and_wait
from kvpool.serve.errors import worker_failed
from kvpool.serve.logprobs import chat_logprobs, completion_logprobs, merge_completion
from kvpool.serve.metrics import ProxyMetrics
from kvpool.serve.protocol import (
    SSE_DONE,
    TextChunks,
    choice_body,
    chunk,
    full_response,
    sse,
    trace_of,
    usage,
    usage_chunk,
)
from kvpool.serve.requests import ChoiceJob, PreparedRequest, Proxy
from kvpool.serve.run import Run
from kvpool.serve.text import TextDelta, TextStream

T = TypeVar("T")


@dataclass
class Choice:
    """One running choice: its job, its run, and its chunk stream past the first chunk."""

    job: ChoiceJob
    run: Run
    first: list[int]
    chunks: AsyncGenerator[list[int]]
    text: TextStream
    sent: int = 0
    """Output tokens whose logprobs went out already."""
    offset: int = 0
    """Characters of the token texts before the next logprobs (completions' text_offset)."""
    finish: str = "stop"
    last_t: float = 0.0
    """When its last chunk came (perf_counter): TBT is observed from it."""
    texts: TextChunks | None = None
    """Its text chunks' maker, once its events begin (shared with its `ChoiceRelay`)."""

    def push(self, metrics: ProxyMetrics, ids: Sequence[int]) -> TextDelta:
        """A chunk's tokens into the choice's text, counted as output (as far as its text
        took them)."""
        text = self.text
        before = text.num_tokens
        delta = text.push_many(ids)
        metrics.output_tokens.inc(text.num_tokens - before)
        return delta

    def arrived(self, metrics: ProxyMetrics, num_tokens: int) -> None:
        """A chunk of `num_tokens` came now: TBT observed as the gap since the last one, per
        token."""
        now = time.perf_counter()
        metrics.tbt.observe((now - self.last_t) / num_tokens)
        self.last_t = now

    @property
    def num_tokens(self) -> int:
        """Output tokens of the choice: as many as its text took, or, for a choice whose
        worker makes its text (past the first chunk: --worker-sse), as many as its frames
        brought."""
        relayed = self.run.sse is not None and not self.text.stopped
        return len(self.run.token_ids) if relayed else self.text.num_tokens


async def _deltas(proxy: Proxy, c: Choice) -> AsyncIterator[tuple[str, str | None]]:
    """(new text, finish reason or None) per chunk; the finish reason comes with the last
    delta. TBT is observed once per chunk, as the gap per token since the last one."""
    m = proxy.metrics
    async with contextlib.aclosing(c.chunks):
        ids, c.last_t = c.first, time.perf_counter()
        while True:
            delta = c.push(m, ids)
            if delta.stopped:
                yield delta.text, "stop"
                return
            if delta.text:
                yield delta.text, None
            try:
                ids = await anext(c.chunks)
            except StopAsyncIteration:
                break
            c.arrived(m, len(ids))
    tail = c.text.flush()  # a stop string may end in the character the output ended inside
    yield tail, "stop" if c.text.stopped else c.run.finish_reason or "stop"


class ChoiceRelay:
    """A streamed choice's chunks taken in its decode worker connection's read callback
    (`Run.relay_chunk`): each one's text and SSE chunk made and written there and then, as
    `_deltas` and `_choice_events` make them (the same TBT and token counts, the same bytes),
    without a task switch or the generators between the worker's stream and the client's.
    Only for what those make without looking ahead or back (`relayable`, `accepts`): the
    frames that come before the stream's head is out, or while the client is slow, and from
    one in which a stop string may end, go the usual way."""

    __slots__ = ("_metrics", "choice", "_writer")

    def __init__(self, metrics: ProxyMetrics) -> None:
        self._metrics = metrics
        self.choice: Choice | None = None
        """Set once the choice exists (its first chunk came)."""
        self._writer: BodyWriter | None = None

    def attach(self, writer: BodyWriter) -> None:
        """The response's body writer, once its head is sent (EventStream's `on_writer`)."""
        self._writer = writer

    def ready(self) -> bool:
        c = self.choice
        return self._writer is not None and c is not None and c.texts is not None \
            and self._writer.ready()

    def accepts(self, ids: list[int]) -> bool:
        """No stop string can end in these tokens, nor ended the text already (a stop ends
        the stream: the generators' part). With --worker-sse the worker finds the stop
        strings in the text it makes (its finish line is the generators' to read)."""
        c = self.choice
        return c is not None and not c.text.stopped and (c.run.sse is not None
                                                         or c.text.cannot_stop(ids))

    def take(self, ids: list[int]) -> None:
        c, m = self.choice, self._metrics
        assert c is not None and c.texts is not None and self._writer is not None  # ready()
        m.read_relay_frames.inc()
        c.arrived(m, len(ids))
        if c.run.sse is not None:  # the worker's text, as `_relayed` relays it
            m.output_tokens.inc(len(ids))
            if c.run.frame_sse:
                self._writer.write(c.run.frame_sse.encode())
            return
        delta = c.push(m, ids)
        assert not delta.stopped, "accepts() said no stop string ends here"
        if delta.text:
            self._writer.write(c.texts.sse(delta.text))


def relayable(prep: PreparedRequest, jobs: int) -> bool:
    """Whether a request's one streamed choice may take its chunks in the read callback
    (`ChoiceRelay`): its chunks are text alone (no logprobs, echo, trace or scoring). With stop
    strings, only chunks in which none can end (`TextStream.cannot_stop`): from the first that
    might, the generators take the stream."""
    return prep.stream and jobs == 1 and prep.logprobs is None and not prep.echo \
        and not prep.trace and not prep.score_only


def usage_of(prep: PreparedRequest, choices: list[Choice]) -> dict[str, Any]:
    """Prompt tokens once per prompt (its first choice's reuse), output tokens of every
    choice."""
    cached = {c.job.prompt_index: c.run.cached_len for c in reversed(choices)}
    outputs = sum(c.num_tokens for c in choices)
    return usage(sum(len(p) for p in prep.prompts), outputs, sum(cached.values()))


def _logprobs(proxy: Proxy, prep: PreparedRequest, c: Choice, upto: int,
              with_prompt: bool) -> dict[str, Any] | None:
    """The logprobs of output tokens `c.sent..upto` (after the echoed prompt's, if
    `with_prompt`), which then count as sent."""
    if prep.logprobs is None:
        return None
    decode, run = proxy.tokenizer.decode, c.run
    ids, entries = run.token_ids[c.sent:upto], run.logprobs[c.sent:upto]
    c.sent = upto
    if prep.kind == "chat":
        return chat_logprobs(decode, entries)
    parts = []
    if with_prompt:
        prompt = c.job.prompt_ids
        parts.append(completion_logprobs(decode, prompt,
                                         run.prompt_logprobs or [None] * len(prompt)))
        c.offset = sum(len(t) for t in parts[0]["tokens"])
    parts.append(completion_logprobs(decode, ids, entries, c.offset))
    c.offset += sum(len(t) for t in parts[-1]["tokens"])
    return merge_completion(parts)


async def full_body(proxy: Proxy, prep: PreparedRequest, choices: list[Choice]) -> dict[str, Any]:
    """Raises WorkerCallError if a leg fails before the end."""
    await _all(_collect(proxy, c) for c in choices)
    bodies = []
    for c in choices:
        echo = proxy.tokenizer.decode(c.job.prompt_ids) if prep.echo else ""
        lp = _logprobs(proxy, prep, c, c.text.num_tokens, prep.echo)
        bodies.append(choice_body(prep.kind, c.job.index, echo + c.text.text, c.finish, lp))
    body = full_response(prep.kind, prep.request_id, proxy.model_name, bodies,
                         usage_of(prep, choices))
    return body | _trace(prep, choices)


async def _collect(proxy: Proxy, c: Choice) -> None:
    async for _, reason in _deltas(proxy, c):  # the text accumulates in c.text
        c.finish = reason or c.finish


async def _all(aws: Iterable[Awaitable[T]]) -> list[T]:
    """Await them together; the first failure cancels the rest (which closes their streams)
    and is raised."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        await cancel_and_wait(*tasks)


def _trace(prep: PreparedRequest, choices: list[Choice]) -> dict[str, Any]:
    if not prep.trace:
        return {}
    run = choices[0].run
    return {"kvpool_trace": trace_of(run.received_t, run.decision_s, run.token_ids, run.token_t,
                                     run.recv_t, run.kv_bytes_moved)}


class _Finish(bytes):
    """A choice's finish chunk: with one choice, written with what follows it (the usage
    chunk, [DONE] and the body's end) in one write."""


async def sse_stream(proxy: Proxy, prep: PreparedRequest, choices: list[Choice],
                     acc: Access | None = None) -> AsyncIterator[bytes]:
    one = len(choices) == 1
    events = _events(proxy, prep, choices[0]) if one else \
        _merged([_events(proxy, prep, c) for c in choices])
    tail = b""
    try:
        async for event in events:
            if one and isinstance(event, _Finish):  # the last event of the choice
                tail = event
                continue
            yield event
    except WorkerCallError as exc:
        if acc is not None:
            acc.note = "worker_failed"
        yield LastChunk(tail + worker_failed(str(exc)).sse() + SSE_DONE)
        return
    if prep.include_usage or prep.trace:
        tail += sse(usage_chunk(prep.kind, prep.request_id, proxy.model_name,
                                usage_of(prep, choices)) | _trace(prep, choices))
    yield LastChunk(tail + SSE_DONE)


def _events(proxy: Proxy, prep: PreparedRequest, c: Choice) -> AsyncIterator[bytes]:
    """A choice's SSE events: relayed from its decode worker (--worker-sse), or made here."""
    return _relayed(proxy, prep, c) if c.run.sse is not None else _choice_events(proxy, prep, c)


async def _relayed(proxy: Proxy, prep: PreparedRequest, c: Choice) -> AsyncIterator[bytes]:
    """--worker-sse: the first chunk made here (from the prefill leg's token or the first
    frame, by the same text stream the worker runs), then each frame's events and the finish's
    as the decoding worker made them: no detokenizing, no JSON made here per frame."""
    m, texts = proxy.metrics, TextChunks(prep.kind, prep.request_id, proxy.model_name, c.job.index)
    if prep.kind == "chat":
        yield sse(chunk(prep.kind, prep.request_id, proxy.model_name, "", None, first=True,
                        index=c.job.index))
    c.texts = texts  # its events began: a ChoiceRelay may take frames from here on
    finish: str | None = None
    async with contextlib.aclosing(c.chunks):
        c.last_t = time.perf_counter()  # the first chunk came (TBT from here, as `_deltas`)
        delta = c.push(m, c.first)
        if delta.text:
            yield texts.sse(delta.text)
        if delta.stopped:
            finish = "stop"
        else:
            async for ids in c.chunks:
                c.arrived(m, len(ids))
                m.output_tokens.inc(len(ids))  # the worker's text: its frames' tokens
                if c.run.frame_sse:
                    yield c.run.frame_sse.encode()
    c.finish = finish or c.run.finish_reason or "stop"
    if finish is None and c.run.finish_sse is not None:
        yield _Finish(c.run.finish_sse.encode())
        return
    if finish is None:  # no finish line: its worker failed after the last token it owed
        tail = _held_tail(c)
        if c.text.stopped:  # a stop string ends in what the worker held
            c.finish = "stop"
        if tail:
            yield texts.sse(tail)
    yield _Finish(sse(chunk(prep.kind, prep.request_id, proxy.model_name, None, c.finish,
                            index=c.job.index)))


def _held_tail(c: Choice) -> str:
    """--worker-sse, a stream whose decode worker failed once its output was complete (no
    finish line, `Run._complete`): the text that worker held back for its finish (an
    unfinished character, the beginning of a stop string), found by the proxy's own text
    stream (`c.text`) taking the tokens the worker made text of, as the worker's did: up to a
    stop string, where one ends there (`c.text.stopped` then)."""
    text = c.text
    text.push_many(c.run.token_ids[text.num_tokens:])  # their text went out from the worker
    return "" if text.stopped else text.flush()


async def _choice_events(proxy: Proxy, prep: PreparedRequest,
                         c: Choice) -> AsyncIterator[bytes]:
    kind, rid, model, i = prep.kind, prep.request_id, proxy.model_name, c.job.index
    if kind == "chat":
        yield sse(chunk(kind, rid, model, "", None, first=True, index=i))
    elif prep.echo:
        prompt_text = proxy.tokenizer.decode(c.job.prompt_ids)
        lp = _logprobs(proxy, prep, c, 0, True)
        yield sse(chunk(kind, rid, model, prompt_text, None, index=i, logprobs=lp))
    texts = c.texts = TextChunks(kind, rid, model, i)
    async for piece, finish in _deltas(proxy, c):
        upto = c.text.num_tokens
        if piece or (finish is not None and prep.logprobs is not None and upto > c.sent):
            lp = _logprobs(proxy, prep, c, upto, False)
            yield texts.sse(piece) if lp is None else sse(chunk(kind, rid, model, piece, None,
                                                                index=i, logprobs=lp))
        if finish is not None:
            yield _Finish(sse(chunk(kind, rid, model, None, finish, index=i)))


async def _merged(streams: list[AsyncIterator[bytes]]) -> AsyncIterator[bytes]:
    """The items of every stream as they come; the first failure is raised and the other
    streams closed (as they are when the consumer stops early). A few items per stream wait
    at most: a client that reads slowly holds back the streams (and their workers) as it
    does a single one, instead of the proxy holding every choice's whole output."""
    if len(streams) == 1:
        async for one in streams[0]:
            yield one
        return
    queue: asyncio.Queue[bytes | BaseException | None] = asyncio.Queue(2 * len(streams))

    async def pump(s: AsyncIterator[bytes]) -> None:
        try:
            async for item in s:
                await queue.put(item)
            await queue.put(None)
        except Exception as exc:
            await queue.put(exc)
    tasks = [asyncio.ensure_future(pump(s)) for s in streams]
    try:
        for _ in range(len(tasks)):
            while (item := await queue.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield item
    finally:
        await cancel_and_wait(*tasks)
