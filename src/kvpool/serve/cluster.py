"""The live cluster as the conductor sees it: workers, their `/load` reports, and the
`ClusterView` + `PrefixIndex` built from them. Sans-I/O: the poller feeds it JSON and the
current time; the dispatcher books requests on it. The one writer of the view.

Instance ids are positions in `view.prefill` / `view.decode`. They are reassigned whenever a
worker joins or leaves (the view is rebuilt), so a `Booking` holds the load objects themselves
and books through them only while they are still in the view.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from kvpool.clock import Clock
from kvpool.conductor import (
    Accepted,
    ClusterView,
    CostModel,
    DecodeLoad,
    PrefillLoad,
    PrefixIndex,
    RequestInfo,
)
from kvpool.engine.worker.messages import InfoReply, LoadReply
from kvpool.errors import InvalidArgument
from kvpool.log import get_logger

log = get_logger("serve.cluster")

PREFILL_ROLES = ("prefill", "both")
DECODE_ROLES = ("decode", "both")


class Down:
    """A worker's leaving the rotation, set once: `is_set`, and callbacks called at `set`
    (a leg's watch subscribes for its length: no task waiting on an event per leg)."""

    def __init__(self) -> None:
        self._set = False
        self._callbacks: set[Callable[[], None]] = set()

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        if self._set:
            return
        self._set = True
        callbacks, self._callbacks = self._callbacks, set()
        for callback in callbacks:
            callback()

    def subscribe(self, callback: Callable[[], None]) -> None:
        self._callbacks.add(callback)

    def unsubscribe(self, callback: Callable[[], None]) -> None:
        self._callbacks.discard(callback)


@dataclass
class WorkerState:
    url: str
    info: InfoReply | None = None
    alive: bool = False
    failures: int = 0
    """Refused polls in a row."""
    last_ok_s: float = 0.0
    load: LoadReply = field(default_factory=LoadReply)
    blocks: set[int] = field(default_factory=set)
    epoch: str = ""
    """The worker's block-event numbering and how far it was read (`/load?epoch=&since=`)."""
    events_to: int = 0
    prefill_load: PrefillLoad | None = None
    decode_load: DecodeLoad | None = None
    shift_s: float = 0.0
    """Sum of the prediction errors applied to busy_until_s so far (as the simulator keeps)."""
    down: Down = field(default_factory=Down)
    """Set when the worker leaves the rotation; in-flight legs on it end at once."""

    @property
    def role(self) -> str:
        return self.info.role if self.info else "unknown"

    @property
    def makes_text(self) -> bool:
        """Its /info says it makes a stream's SSE text when asked (InfoReply.sse_text)."""
        return self.info is not None and self.info.sse_text


@dataclass
class Booking:
    """An accepted request's place in the view, released exactly once by `finish`."""

    req: RequestInfo
    prefill: WorkerState
    decode: WorkerState
    prefill_load: PrefillLoad
    decode_load: DecodeLoad
    decision: Accepted
    alone: bool = False
    """Nothing else was queued on the prefill worker when this request was booked."""
    predicted_end_s: float = 0.0
    """The prefill worker's predicted busy_until_s right after booking (this request's end)."""
    shift_then_s: float = 0.0
    prefill_pending: bool = True
    direct: bool = False
    """Conditional disaggregation sent it straight to its decode worker (no prefill leg)."""
    decode_started: bool = False
    finished: bool = False
    remote: bool = False
    """Booked by another process of the same proxy (serve/shared_bookings.py)."""

    @property
    def colocated(self) -> bool:
        return self.prefill is self.decode


class BookingSink(Protocol):
    """Told of this process's own booking events (`kvpool proxy --workers N`: the others')."""

    def booked(self, b: Booking) -> None: ...

    def prefill_done(self, b: Booking) -> None: ...

    def decode_started(self, b: Booking) -> None: ...

    def decode_moved(self, b: Booking) -> None: ...

    def finished(self, b: Booking) -> None: ...


class LiveCluster:
    def __init__(self, cost: CostModel, clock: Clock, dead_after_failures: int = 2,
                 silent_dead_s: float = 10.0) -> None:
        self.cost = cost
        self.clock = clock
        self.silent_dead_s = silent_dead_s
        self.dead_after_failures = dead_after_failures
        self.workers: dict[str, WorkerState] = {}
        self.view = ClusterView([], [], PrefixIndex())
        self.sink: BookingSink | None = None
        """Told of every booking event of this process's own (`--workers N`)."""
        self.in_flight = 0
        """This process's own bookings not yet finished (requests in flight here)."""
        self._prefill: list[WorkerState] = []
        self._decode: list[WorkerState] = []

    # -- membership -------------------------------------------------------------------------

    def add(self, url: str) -> WorkerState:
        """Start watching `url` (idempotent); it joins once its /info is known."""
        return self.workers.setdefault(url.rstrip("/"), WorkerState(url.rstrip("/")))

    @property
    def reference(self) -> InfoReply | None:
        """The first joined worker's info: every other worker must share model and block size."""
        return next((w.info for w in self.workers.values() if w.info is not None), None)

    def join(self, url: str, info: InfoReply) -> None:
        """Put the worker into rotation. Raises InvalidArgument when it serves another model
        identity (other weights, dtype or KV layout: its block hashes would never match) or
        another block size."""
        w = self.workers[url]
        ref = self.reference if w.info is None else w.info
        if ref is not None and (ref.model_hash, ref.block_size) != (info.model_hash, info.block_size):
            raise InvalidArgument(
                f"worker {url} serves model hash {info.model_hash:x} with block size "
                f"{info.block_size}, the cluster {ref.model_hash:x} / {ref.block_size} (the "
                f"hash covers the weights' contents, the dtype and the KV layout: start every "
                f"worker on the same checkpoint with the same --dtype and --block-size)")
        w.info, w.alive, w.failures, w.last_ok_s = info, True, 0, self.clock.now()
        w.down = Down()
        w.prefill_load = PrefillLoad(0) if info.role in PREFILL_ROLES else None
        w.shift_s = 0.0
        w.decode_load = (DecodeLoad(0, info.kv_capacity_tokens)
                         if info.role in DECODE_ROLES else None)
        self._rebuild()
        log.info("worker %s joined as %s", url, info.role)

    def clock_now(self) -> float:
        return self.clock.now()

    def poll_failed(self, url: str, refused: bool) -> bool:
        """Count a failed poll; True when this one takes the worker out of rotation: refused
        connections `dead_after_failures` times in a row, or no good poll for `silent_dead_s`
        (a busy worker may answer slowly; a dead one refuses at once)."""
        w = self.workers[url]
        w.failures += 1 if refused else 0
        silent = self.clock.now() - w.last_ok_s >= self.silent_dead_s
        if not w.alive or (w.failures < self.dead_after_failures and not silent):
            return False
        self.withdraw(url, f"after {w.failures} failed polls")
        return True

    def withdraw(self, url: str, why: str) -> None:
        """Take `url` out of the rotation now (its runs are handed over: `down` is set); it
        rejoins only through a good poll after a new proof."""
        w = self.workers[url]
        if not w.alive:
            return
        w.alive = False
        w.blocks, w.epoch, w.events_to = set(), "", 0
        w.down.set()
        self._rebuild()
        log.warning("worker %s left the rotation %s", url, why)

    def _rebuild(self) -> None:
        alive = sorted((w for w in self.workers.values() if w.alive), key=lambda w: w.url)
        self._prefill = [w for w in alive if w.prefill_load is not None]
        self._decode = [w for w in alive if w.decode_load is not None]
        index = PrefixIndex()
        for i, w in enumerate(self._prefill):
            assert w.prefill_load is not None
            w.prefill_load.instance_id = i
            for h in w.blocks:
                index.add(i, h)
        for j, w in enumerate(self._decode):
            assert w.decode_load is not None
            w.decode_load.instance_id = j
        self.view = ClusterView([w.prefill_load for w in self._prefill if w.prefill_load],
                                [w.decode_load for w in self._decode if w.decode_load], index,
                                {w.prefill_load.instance_id: w.decode_load.instance_id
                                 for w in self._prefill if w.prefill_load and w.decode_load})

    # -- load reports -----------------------------------------------------------------------

    def apply_load(self, url: str, load: LoadReply, now: float) -> None:
        """Fold one /load reply in: the worker's cached blocks into the prefix index. (Queues
        are the conductor's own predictions, corrected as each prefill ends, as in the
        simulator; the reported queue is kept for /metrics.)"""
        w = self.workers[url]
        w.failures, w.last_ok_s = 0, now
        w.load = load
        if load.block_hashes is not None:
            blocks = set(load.block_hashes)
            events = [(h, True) for h in blocks - w.blocks] + [(h, False) for h in w.blocks - blocks]
        else:
            events = list(load.block_events or ())
        index = self.view.index if w.alive and w.prefill_load is not None else None
        for h, stored in events:
            if stored:
                if h not in w.blocks:  # (stored again: held already)
                    w.blocks.add(h)
                    if index is not None:
                        index.add(w.prefill_load.instance_id, h)  # type: ignore[union-attr]
            elif h in w.blocks:
                w.blocks.discard(h)
                if index is not None:
                    index.remove(w.prefill_load.instance_id, h)  # type: ignore[union-attr]
        w.epoch, w.events_to = load.epoch, load.events_to
        if w.decode_load is not None and w.load.kv_capacity_tokens > 0:
            w.decode_load.kv_capacity_tokens = w.load.kv_capacity_tokens

    # -- bookings ---------------------------------------------------------------------------

    def is_colocated(self, decision: Accepted) -> bool:
        """Whether `decision` prefills and decodes on the same worker."""
        return self.view.colocated.get(decision.prefill.instance_id) == \
            decision.decode.instance_id

    def book(self, req: RequestInfo, decision: Accepted, now: float,
             remote: bool = False) -> Booking:
        p = self._prefill[decision.prefill.instance_id]
        d = self._decode[decision.decode.instance_id]
        assert p.prefill_load is not None and d.decode_load is not None
        alone = p.prefill_load.num_queued == 0
        self.view.record_accept(req, decision, now)
        b = Booking(req, p, d, p.prefill_load, d.decode_load, decision, alone,
                    p.prefill_load.busy_until_s, p.shift_s, remote=remote)
        if not remote:
            self.in_flight += 1
            if self.sink is not None:
                self.sink.booked(b)
        return b

    def _in_view(self, b: Booking, prefill: bool) -> bool:
        if prefill:
            return any(load is b.prefill_load for load in self.view.prefill)
        return self._decoding_in_view(b.decode_load)

    def _decoding_in_view(self, load: DecodeLoad | None) -> bool:
        return any(x is load for x in self.view.decode)

    def prefill_done(self, b: Booking, now: float, ran: bool = True) -> None:
        """The booking's prefill answered (`ran`), or it ends without having run (refused,
        failed, closed before its reply): it leaves the queue either way, but only a prefill
        that ran says how far off the queue's prediction was."""
        if not b.prefill_pending:
            return
        b.prefill_pending = False
        if self.sink is not None and not b.remote:
            self.sink.prefill_done(b)
        if self._in_view(b, prefill=True):
            self.view.record_prefill_done(b.prefill_load.instance_id)
            load = b.prefill_load
            if ran and not b.direct:  # (a direct one's first token is the decode worker's)
                # the queue behind this request starts later (or earlier) than predicted:
                # shift it by the error, exactly as kvpool.sim.disagg does
                delta = now - (b.predicted_end_s + b.prefill.shift_s - b.shift_then_s)
                load.busy_until_s += delta
                b.prefill.shift_s += delta
            if load.num_queued <= 0:  # nothing booked there any more: it is idle
                load.busy_until_s = min(load.busy_until_s, now)

    def decode_start(self, b: Booking, now: float) -> None:
        if b.decode_started or b.finished:
            return
        b.decode_started = True
        if self.sink is not None and not b.remote:
            self.sink.decode_started(b)
        if self._in_view(b, prefill=False):
            self.view.record_decode_start(b.decode_load.instance_id, b.req, now)

    def move_decode(self, b: Booking, to: WorkerState, now: float) -> None:
        """The booking's decode moves to `to` (a failed leg resumed there): it leaves the old
        worker's load in the view and joins the new one's, decoding from its next frame."""
        if b.finished or to.decode_load is None or not self._decoding_in_view(to.decode_load):
            return
        if self._in_view(b, prefill=False):
            self.view.record_decode_end(b.decode_load.instance_id, b.req, b.decode_started)
        b.decode, b.decode_load, b.decode_started = to, to.decode_load, False
        self.view.record_decode_moved(to.decode_load.instance_id, b.req, now)
        if self.sink is not None and not b.remote:
            self.sink.decode_moved(b)

    def finish(self, b: Booking, now: float) -> None:
        """Release the booking (finished, failed or abandoned); idempotent."""
        if b.finished:
            return
        self.prefill_done(b, now, ran=False)  # (when it ran, its reply said so already)
        b.finished = True
        if not b.remote:
            self.in_flight -= 1
            if self.sink is not None:
                self.sink.finished(b)
        if self._in_view(b, prefill=False):
            self.view.record_decode_end(b.decode_load.instance_id, b.req, b.decode_started)

    # -- reading ----------------------------------------------------------------------------

    def alive(self, role_set: tuple[str, ...]) -> list[WorkerState]:
        return [w for w in self.workers.values() if w.alive and w.role in role_set]

    @property
    def prefill_urls(self) -> list[str]:
        """The prefill workers in rotation, in the view's order (index = instance id)."""
        return [w.url for w in self._prefill]

    @property
    def max_model_len(self) -> int | None:
        lens = [w.info.max_model_len for w in self.workers.values() if w.alive and w.info]
        return min(lens) if lens else None

    def check_integrity(self) -> None:
        """The index holds exactly the blocks of the prefill workers in rotation."""
        expected = {h: {i} for i, w in enumerate(self._prefill) for h in w.blocks}
        for i, w in enumerate(self._prefill):
            for h in w.blocks:
                expected[h].add(i)
        for h, holders in expected.items():
            assert set(self.view.index.holders(h)) == holders, (h, holders)
        assert len(self.view.index) == len(expected)
        for d in self.view.decode:
            assert d.num_assigned >= d.num_active >= 0, d
