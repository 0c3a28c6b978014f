"""One request's legs (`Run`): the prefill leg and the decode legs on the workers the
dispatcher booked, resumed on another worker when one fails under them, released however the
request ends.

    run = Run(dispatcher, booking, request_id, prompt_ids, sampling)
    run.chunks()                      -> [token id, ...] ...  (WorkerCallError when a leg fails)
    run.finish_reason, run.cached_len    set once the stream ends
    run.ready(), run.take(frame)         a decode leg's frames taken in the worker connection's
                                         read callback (FrameRelay), when the app set
                                         `relay_chunk`

A leg on a worker that leaves the rotation (failed polls) ends at once with WorkerCallError, so
a hung worker cannot hang a client. Ending a run early (stop string, client gone) aborts it on
the workers.

A chunk is what one frame of the decode leg carries: the tokens one engine step made (several
steps' with a stream interval over 1); the prefill leg's token is a chunk of its own.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, replace
from typing import Any, Protocol

from kvpool.engine.config import SamplingParams
from kvpool.engine.sequence import TokenLogprob
from kvpool.engine.worker.messages import (
    FinishLine,
    Frame,
    GenerateRequest,
    KVMode,
    KVSourceName,
    KVTransfer,
    PlainFrame,
    PrefillRequest,
    SseSpec,
)
from kvpool.errors import WorkerCallError
from kvpool.log import get_logger
from kvpool.serve.cluster import DECODE_ROLES, Booking, WorkerState
from kvpool.serve.dispatch import Dispatcher
from kvpool.serve.legwatch import LegWatch, watched

log = get_logger("serve.run")


def migratable(exc: WorkerCallError) -> bool:
    """Whether a request may go on elsewhere after `exc`: the worker failed (unreachable, out
    of rotation, a broken stream, a 5xx), not the request (a 4xx)."""
    return exc.status is None or exc.status >= 500


class ChunkRelay(Protocol):
    """Where a run's chunks go when they are taken in the read callback (the response's)."""

    def ready(self) -> bool: ...

    def accepts(self, ids: list[int]) -> bool:
        """Whether it can take these tokens there and then (else the generators take them,
        and the rest of the leg)."""

    def take(self, ids: list[int]) -> None: ...


@dataclass(slots=True)
class _Leg:
    """A decode leg's own state (kept on the run: frames are taken by the leg's generator
    or, relayed, in the read callback)."""

    kv_source: KVSourceName
    resumed: bool
    """It resumes a run whose tokens went out already (their prompt reuse is not reported
    again)."""
    skip_echo: bool
    """Its first frame begins with the prefill leg's token, which went out already."""
    last_s: float | None = None
    """When its last frame came (the decode gaps)."""


class Run:
    def __init__(self, dispatcher: Dispatcher, booking: Booking, request_id: str,
                 prompt_ids: list[int], sampling: SamplingParams) -> None:
        self.d = dispatcher
        self.b = booking
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.sampling = sampling
        self.finish_reason: str | None = None
        self.received_t = 0.0
        """CLOCK_MONOTONIC when the proxy received the request (set by the app)."""
        self.decision_s = 0.0
        """How long scheduling took (set by the app)."""
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob | None] = []
        """Each output token's logprob (None unless the request asks)."""
        self.prompt_logprobs: list[TokenLogprob | None] | None = None
        """The prompt's, once the leg that computed the prompt reports them (if asked)."""
        self.token_t: list[float] = []
        """The worker's stamp of each output token (the end of the step that made it)."""
        self.recv_t: list[float] = []
        """When the proxy received each output token (its clock)."""
        self.kv_bytes_moved = 0
        """KV bytes the prefill leg read from the pool and wrote to it (or pushed)."""
        self.cached_len = 0
        """Prompt tokens whose KV was reused (local cache + pool), as the prefill worker says."""
        self.pool_len = 0
        """Of those, tokens whose KV came from the pool (the rest: the worker's own cache)."""
        self._reuse_known = False
        """A colocated leg reported the prompt's reuse (with its first frame, or its finish)."""
        self._tried: set[str] = set()
        """Workers this request failed on (it is resumed on each other worker once at most)."""
        self._decode_url: str | None = None
        """The worker of the current decode leg."""
        self._handoff: dict[str, Any] | None = None
        """The prefill leg's own handoff for the decode leg (an engine's kv_transfer_params)."""
        self.sse: SseSpec | None = None
        """Set (by the app, --worker-sse) when the decode legs make the response's text chunks;
        each frame's then is `frame_sse` when it is yielded, and the finish's `finish_sse`."""
        self.frame_sse: str | None = None
        self.finish_sse: str | None = None
        self.stream_interval = dispatcher.config.stream_interval
        """Output tokens per frame of its decode legs (None: the worker's own); the app sets
        `whole_interval` for a response nobody reads before its end."""
        self.relay_chunk: ChunkRelay | None = None
        """Set (by the app) where the response takes the decode legs' chunks in the worker
        connection's read callback too (`ready`/`take`: the Run is then the legs'
        FrameRelay); None: every chunk comes through `chunks()`."""
        self._leg: _Leg | None = None
        """The current decode leg's state."""

    @property
    def decode_url(self) -> str:
        """The worker of the current (or last) decode leg: the booked one unless resumed."""
        return self._decode_url or self.b.decode.url

    @property
    def _mode(self) -> KVMode:
        """push, else pool: `mooncake` is the vllm backend's own handoff, carried like the
        store connector's by the prefill reply's kv_transfer_params (serve/vllm/backend.py)."""
        return "push" if self.d.config.kv_transfer == "push" else "pool"

    async def chunks(self) -> AsyncGenerator[list[int]]:
        """Output token ids in order, a list per frame. Always close it (aclosing): that
        releases the booking and aborts the request on its workers if it did not finish.

        A worker that fails under a request (it dies, stalls out of rotation, or its stream
        breaks) does not end it: a prefill worker that fails before its first token leaves the
        prompt to the decode worker, and a decode worker that fails mid-stream hands the
        request to another decode worker, which computes the tokens already sent with the
        prompt (whose blocks it loads from the pool) and goes on (`resume_output_ids`): the
        client sees neither a duplicate nor a gap, and each worker is tried once."""
        try:
            first: int | None = None
            kv: KVSourceName = "none"
            if not self.b.colocated and not self.b.direct:
                try:
                    first, kv = await self._prefill_leg(), self._mode
                    if first is not None:
                        yield [first]
                except WorkerCallError as exc:
                    if not migratable(exc):
                        raise
                    self._migrated("prefill", self.b.prefill, exc)
            worker: WorkerState | None = self.b.decode
            while worker is not None:  # the decode legs (here, not in a generator of their own)
                try:
                    async for chunk in self._decode_leg(worker, first, kv):
                        yield chunk
                    return
                except WorkerCallError as exc:
                    worker = self._after_decode_failure(worker, kv, exc)
                    first, kv = None, "none"
        finally:
            self._release()

    def _after_decode_failure(self, worker: WorkerState, kv: KVSourceName,
                              exc: WorkerCallError) -> WorkerState | None:
        """The decode worker to resume on after `exc`; None when the run is complete anyway;
        `exc` raised when it cannot go on."""
        if kv == "pool":  # the prefill's partial block: the failed leg may not read it
            self.d.abort_later(self.b.prefill.url, self.request_id)
        if self.finish_reason is None and len(self.token_ids) >= self.sampling.max_tokens:
            self._complete(worker, exc)  # nothing left for another leg to do
            return None
        if not migratable(exc) or self.finish_reason is not None or \
                not self.d.client.features.migration:
            raise exc
        nxt = self._next_decode(worker)
        if nxt is None:
            raise exc
        self._migrated("decode", worker, exc)
        self.d.cluster.move_decode(self.b, nxt, self.d.clock.now())  # its load goes along
        return nxt

    def _complete(self, worker: WorkerState, exc: WorkerCallError) -> None:
        """The output already holds max_tokens tokens (the prefill's one, for max_tokens 1):
        a leg that fails after that cannot fail the request."""
        self.finish_reason = "length"
        self.d.abort_later(worker.url, self.request_id)
        log.info("request %s: decode leg on %s failed (%s) after the last token; complete",
                 self.request_id, worker.url, exc)

    def _next_decode(self, failed: WorkerState) -> WorkerState | None:
        """Another decode worker in rotation that this request has not tried (fewest running
        requests first; one that makes SSE text where the run's text comes from its decode
        legs), or None."""
        self._tried.add(failed.url)
        left = [w for w in self.d.cluster.alive(DECODE_ROLES) if w.url not in self._tried
                and (self.sse is None or w.makes_text)]
        return min(left, key=lambda w: w.load.num_running) if left else None

    def _migrated(self, leg: str, worker: WorkerState, exc: WorkerCallError) -> None:
        self._tried.add(worker.url)
        self.d.abort_later(worker.url, self.request_id)  # a stalled one must not go on
        self.d.metrics.migrations.labels(leg).inc()
        log.warning("request %s: %s leg on %s failed (%s); resuming on another worker "
                    "after %d tokens", self.request_id, leg, worker.url, exc,
                    len(self.token_ids))

    async def _prefill_leg(self) -> int | None:
        """The prefill leg; its token, or None where the decode leg makes the first token
        (BackendFeatures.first_token_from_prefill)."""
        mode = self._mode
        kv = KVTransfer(mode=mode, decode_url=self.b.decode.url if mode == "push" else None)
        req = PrefillRequest(request_id=self.request_id, prompt_token_ids=self.prompt_ids,
                             sampling=self.sampling, kv_transfer=kv)
        reply = await watched(self.d.client.prefill(self.b.prefill.url, req), self.b.prefill,
                              "/prefill")
        self.d.cluster.prefill_done(self.b, self.d.clock.now())
        self._reused(reply.num_cached_tokens + reply.num_pool_tokens, reply.num_pool_tokens)
        self._handoff = reply.kv_transfer_params
        first = self.d.client.features.first_token_from_prefill
        if first:
            self.prompt_logprobs = reply.prompt_logprobs
            self._record([reply.first_token_id], [reply.first_token_t],
                         None if reply.first_logprob is None else [reply.first_logprob])
        self.kv_bytes_moved = reply.kv_bytes_moved
        self.d.metrics.prompt_tokens.inc(len(self.prompt_ids))
        self.d.metrics.prefix_hit_tokens.inc(self.cached_len)
        self.d.learn(self.b, self.cached_len, reply.prefill_s)
        self.d.check_decode(self.b)
        waited = await self.d.client.handoff(self.b.prefill.url, self.request_id,
                                             self.b.req.block_hashes)
        if waited is not None:
            self.d.metrics.handoff_wait.observe(waited)
        return reply.first_token_id if first else None

    async def _decode_leg(self, worker: WorkerState, first: int | None,
                          kv_source: KVSourceName) -> AsyncIterator[list[int]]:
        # the prompt's logprobs come from the leg that computes it: not this one if it has one
        # (nor a resumed one: they went out with the first token)
        resumed = list(self.token_ids) if first is None else []
        sampling = self.sampling if first is None and not resumed else replace(
            self.sampling, prompt_logprobs=None)
        req = GenerateRequest(request_id=self.request_id, prompt_token_ids=self.prompt_ids,
                              sampling=sampling, first_token_id=first, kv_source=kv_source,
                              resume_output_ids=resumed,
                              kv_transfer_params=self._handoff if kv_source != "none" else None,
                              stream_interval=self.stream_interval, sse=self.sse,
                              merge_steps=self.d.config.merge_frames)
        self._decode_url = worker.url
        self._leg = _Leg(kv_source, resumed=bool(resumed), skip_echo=first is not None)
        lines = self.d.client.generate(worker.url, req,
                                       self if self.relay_chunk is not None else None)
        watch = LegWatch(worker, "/generate")  # one watcher for the stream, not one per line
        try:
            while True:
                try:
                    line = await watch.read(anext(lines))
                except StopAsyncIteration:
                    raise WorkerCallError(worker.url, "/generate",
                                          "stream ended without a finish_reason") from None
                if isinstance(line, FinishLine):
                    self._finished(line)
                    return
                ids = self._frame_ids(line, self.d.clock.now())
                if ids:
                    yield ids
        finally:
            watch.close()
            await lines.aclose()

    def ready(self) -> bool:
        """FrameRelay: a frame of the decode leg may be taken in the read callback."""
        return self.relay_chunk is not None and self.relay_chunk.ready()

    def take(self, frame: PlainFrame) -> bool:
        """FrameRelay: a frame of the decode leg, from the read callback: what the leg would
        have yielded goes to the response's `relay_chunk`, unless it does not accept those
        tokens (then nothing is recorded: the leg's generator reads the frame)."""
        relay = self.relay_chunk
        assert relay is not None and self._leg is not None  # ready() said so
        new = self._unseen(frame, self._leg.skip_echo)[0]
        if new and not relay.accepts(new):
            return False
        ids = self._frame_ids(frame, self.d.clock.now())
        if ids:
            relay.take(ids)
        return True

    def _frame_ids(self, line: Frame, now: float) -> list[int] | None:
        """A frame of the current decode leg (received at `now`) recorded: its output ids,
        or None when it brought none (the prefill leg's token echoed alone)."""
        if not self.b.decode_started:
            self.d.cluster.decode_start(self.b, now)
        leg = self._leg
        assert leg is not None
        echoed, leg.skip_echo = leg.skip_echo, False
        ids, stamps, lps = self._unseen(line, echoed)
        if echoed and not ids:
            return None
        if line.prompt_logprobs is not None:
            self.prompt_logprobs = line.prompt_logprobs
        self._record(ids, stamps, lps, now)
        if leg.kv_source == "none" and self.b.prefill_pending:
            self._colocated_first_token()
        if line.reuse is not None and leg.kv_source == "none" and not leg.resumed:
            self._colocated_reuse(*line.reuse)  # (a stream cut at a stop never finishes)
        leg.last_s = self._decode_gap(leg.last_s, len(ids), now)
        self.frame_sse = line.sse
        return ids

    @staticmethod
    def _unseen(line: Frame, echoed: bool) -> tuple[list[int], list[float],
                                                   list[TokenLogprob | None] | None]:
        """A frame's ids, stamps and logprobs, less the prefill leg's token where it is
        `echoed` (a leg's first frame begins with it, and it went out already:
        `_Leg.skip_echo`)."""
        if echoed:
            lps = line.logprobs
            return line.token_ids[1:], line.t[1:], None if lps is None else lps[1:]
        return line.token_ids, line.t, line.logprobs

    def _finished(self, line: FinishLine) -> None:
        """The current decode leg's finish line."""
        if not self.b.decode_started:
            self.d.cluster.decode_start(self.b, self.d.clock.now())
        self.finish_reason, self.finish_sse = line.finish_reason, line.sse
        leg = self._leg
        assert leg is not None
        if leg.kv_source == "none" and not leg.resumed:  # the prompt's reuse, if reported
            self._colocated_reuse(line.num_cached_tokens, line.num_pool_tokens)

    def _record(self, tokens: list[int], stamps: list[float],
                logprobs: list[TokenLogprob | None] | None, now: float | None = None) -> None:
        n = len(tokens)
        self.token_ids += tokens
        self.logprobs += logprobs if logprobs is not None else [None] * n
        self.token_t += stamps
        self.recv_t += [self.d.clock.now() if now is None else now] * n

    def _decode_gap(self, last_s: float | None, num_tokens: int, now: float) -> float:
        """Record the gap since the previous decode-leg frame (received at `now`), per token
        of this one (a step's time, at one token per step), once for each of its tokens, with
        the decode worker's batch."""
        if last_s is not None:
            d = self.b.decode_load
            self.d.measured.add_decode(d.num_active, d.active_tokens, (now - last_s) / num_tokens,
                                       num_tokens)
        return now

    def _colocated_reuse(self, cached: int, pool: int) -> None:
        """A colocated leg's prompt reuse, counted once (the first frame and the finish
        line both say it)."""
        if self._reuse_known:
            return
        self._reuse_known = True
        self._reused(cached + pool, pool)
        self.d.metrics.prefix_hit_tokens.inc(self.cached_len)

    def _reused(self, total: int, pool: int) -> None:
        """The prompt tokens reused, and of those from the pool: as the engine says, or where
        it does not (BackendFeatures.reports_pool_tokens), beyond what the placement found in
        the instance's own cache."""
        if not self.d.client.features.reports_pool_tokens:
            pool = max(0, total - self.b.decision.prefill.local_prefix_len)
        self.cached_len, self.pool_len = total, pool

    def _colocated_first_token(self) -> None:
        self.d.cluster.prefill_done(self.b, self.d.clock.now())
        self.d.metrics.prompt_tokens.inc(len(self.prompt_ids))

    def discard(self) -> None:
        """Release the booking of a run whose `tokens()` was never started."""
        self.d.cluster.finish(self.b, self.d.clock.now())

    def _release(self) -> None:
        self.relay_chunk = None  # its choice holds this run: no cycle left for the collector
        b = self.b
        if self.finish_reason is None:
            if not b.colocated and not b.direct:  # it may hold KV for this run
                self.d.abort_later(b.prefill.url, self.request_id)
            self.d.abort_later(b.decode.url, self.request_id)
            if self._decode_url not in (b.decode.url, None):  # where it was resumed
                self.d.abort_later(self._decode_url, self.request_id)
        self.d.cluster.finish(b, self.d.clock.now())
