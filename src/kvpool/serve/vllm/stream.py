"""A vLLM decode leg's stream read into the proxy's frames (`stream_frames`): its token chunks a
frame per read, then one finish line; the lines of a reply as the lean client or httpx reads
them (`call_lines`, `one_by_one`); and the count of its output tokens, taken by the reader and
the read-callback relay alike (`Tally`)."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass

import httpx

from kvpool.engine.sequence import TokenLogprob
from kvpool.engine.worker.messages import FinishLine, Frame, PlainFrame, TokensLine
from kvpool.errors import WorkerCallError
from kvpool.log import get_logger
from kvpool.serve.ndjson_reply import ReplyError as HttpReplyError
from kvpool.serve.vllm.wire import COMPLETIONS, ReplyError, stream_delta
from kvpool.serve.worker_stream import StreamCall

log = get_logger("serve.vllm")


async def stream_frames(url: str, batches: AsyncIterator[Sequence[str | bytes]],
                    logprobs_k: int | None,
                    tally: Tally | None = None) -> AsyncGenerator[Frame | FinishLine]:
    """The stream's tokens, a frame per read (the chunks that came in together, as one
    engine step's would), then one finish line once the stream is done (after vLLM's usage
    chunk, which says how many prompt tokens were cached). `tally` counts the output
    tokens, those a relay took in the read callback too (`read_relay`, `wire.token_chunks`).
    A stream that breaks after its finish chunk has finished all the same: the answer is
    whole (resuming it would make tokens past its end), only the cached count is lost."""
    finish: str | None = None
    cached = 0
    tally = tally or Tally()
    try:
        async for batch in batches:
            ids: list[int] = []
            lps: list[TokenLogprob | None] = []
            for raw in batch:
                try:
                    delta = stream_delta(raw, logprobs_k)
                except ReplyError as exc:
                    raise WorkerCallError(url, COMPLETIONS, str(exc)) from None
                if delta is None:
                    continue
                ids += delta.token_ids
                if logprobs_k is not None:
                    lps += delta.logprobs
                finish = delta.finish_reason or finish
                cached = delta.num_cached_tokens if delta.num_cached_tokens is not None \
                    else cached
            if ids:
                tally.num_tokens += len(ids)
                stamps = [time.monotonic()] * len(ids)
                yield PlainFrame(ids, stamps) if logprobs_k is None else \
                    TokensLine(token_ids=ids, t=stamps, logprobs=lps)
    except (WorkerCallError, OSError, HttpReplyError, httpx.HTTPError) as exc:
        if finish is None:
            raise
        log.debug("%s on %s broke after its finish chunk: %r", COMPLETIONS, url, exc)
    if finish is not None:
        yield FinishLine(finish_reason=finish, num_output_tokens=tally.num_tokens,
                         num_cached_tokens=cached)


@dataclass(slots=True)
class Tally:
    """A decode leg's output tokens so far, counted by its reader and its relay alike."""

    num_tokens: int = 0

    def add(self, frame: PlainFrame) -> None:
        self.num_tokens += len(frame.token_ids)


async def call_lines(call: StreamCall) -> AsyncIterator[list[bytes]]:
    """The lines of a reply read by the lean client, a list per read."""
    while batch := await call.next_lines():
        yield batch


async def one_by_one(lines: AsyncIterator[str]) -> AsyncIterator[list[str]]:
    async for line in lines:
        yield [line]
