"""Transfer requests, their per-request status, and batches that track completion."""

from __future__ import annotations

import contextlib
import enum
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from kvpool.errors import InvalidArgument
from kvpool.log import get_logger

log = get_logger("transfer.batch")


class OpCode(enum.IntEnum):
    READ = 0  # copy target memory into the local buffer
    WRITE = 1  # copy the local buffer into target memory


class RequestState(enum.IntEnum):
    PENDING = 0
    DONE = 1
    FAILED = 2


class TransferRequest(NamedTuple):
    """One copy between local memory and a peer's. `target` is the peer's segment name,
    "host:port"; `fence` the fence of the target region this request was planned against
    (0: none): a fenced target region refuses a request whose fence differs (status FENCED).
    (A named tuple: built once per object on every store call, in a fifth of the time of a
    frozen dataclass.)"""

    op: OpCode
    local_addr: int
    length: int
    target: str
    target_addr: int
    fence: int = 0


@dataclass(frozen=True, slots=True)
class RequestStatus:
    state: RequestState
    reason: str | None = None

    @property
    def ok(self) -> bool:
        return self.state == RequestState.DONE


PENDING = RequestStatus(RequestState.PENDING)
DONE = RequestStatus(RequestState.DONE)


class Batch:
    """Per-request completion of one submitted batch.

    A request may travel as several slices; it is DONE only when every slice succeeded, and
    FAILED (with the first reason) as soon as one failed: partial success is never success.

    `on_done(index)` is called as each request becomes DONE, in the thread that moved its
    last bytes (which are then warm in that CPU's cache, and threads that moved bytes in
    parallel also work on them in parallel: the store client hashes objects there), before
    the batch can count as finished: a waiter sees every call made. An exception in it is
    logged and ignored.

    `on_sent(index)` (tcp) is called once the last open slice of a request was handed to
    the socket, before the peer answers: the source bytes are all sent, so a writer can
    work on them (the store client hashes them) while the peer takes them in; for a read,
    once its last open slice's bytes are in local memory while the rest of its frame still
    arrives (a large frame of several requests). It may come before `on_done` or not at
    all (a request whose slices finish out of order, a small read); a request whose frame
    then fails is FAILED all the same.
    """

    def __init__(self, capacity: int, on_done: Callable[[int], None] | None = None,
                 on_sent: Callable[[int], None] | None = None) -> None:
        self.capacity = capacity
        self.on_done = on_done
        self.on_sent = on_sent
        self._cond = threading.Condition()
        self._remaining: list[int] = []
        self._status: list[RequestStatus] = []
        self._open = 0
        self._callbacks: list[Callable[[], None]] = []
        self._running: dict[int, socket.socket | None] = {}
        """Connections of the frames of this batch moving bytes on worker threads (None for
        a copy in memory: shared memory or the own segment, which cannot be cut short)."""
        self._given_up = False
        self._failed = False
        """A request failed: other frames of the batch (its other slices, the others'
        requests) may still be under way, or queued, when every request is decided."""

    def add(self, slices_per_request: list[int]) -> int:
        """Reserve slots for new requests; returns the index of the first."""
        with self._cond:
            if len(self._status) + len(slices_per_request) > self.capacity:
                raise InvalidArgument(
                    f"batch capacity {self.capacity} exceeded: {len(self._status)} submitted, "
                    f"{len(slices_per_request)} more requested; allocate a larger batch"
                )
            first = len(self._status)
            self._remaining.extend(slices_per_request)
            self._status.extend([PENDING] * len(slices_per_request))
            self._open += len(slices_per_request)
            return first

    def complete(self, indices: list[int], reason: str | None = None, whole: bool = False) -> None:
        """One slice (or, with `whole`, all slices) of each request in `indices` finished.

        A None reason means success.
        """
        with self._cond:
            done = []
            for index in indices:
                if whole and reason is None:
                    self._remaining[index] = 1
                if self._complete_one(index, reason):
                    done.append(index)
            if self.on_done is None:
                callbacks = self._count_finished(len(done))
        if self.on_done is not None:
            for index in done:
                notify_done(self.on_done, index)
            with self._cond:
                callbacks = self._count_finished(len(done))
        for callback in callbacks:
            try:
                callback()
            except Exception:  # a waiter that went away must not break the reporting thread
                log.debug("batch completion callback failed", exc_info=True)

    def sent(self, indices: list[int]) -> None:
        """One slice of each request in `indices` was sent (a read's: its bytes arrived);
        calls `on_sent` for each request whose last open slice it was."""
        if self.on_sent is None:
            return
        with self._cond:
            last = [i for i in indices if self._remaining[i] == 1
                    and self._status[i].state == RequestState.PENDING]
        for index in last:
            notify_done(self.on_sent, index)

    def _complete_one(self, index: int, reason: str | None) -> bool:
        """One slice's outcome; True when the request just became DONE (the caller counts it
        finished, after on_done)."""
        if self._status[index].state != RequestState.PENDING:
            return False
        if reason is not None:
            self._status[index] = RequestStatus(RequestState.FAILED, reason)
            self._open -= 1
            self._failed = True
            return False
        self._remaining[index] -= 1
        if self._remaining[index] == 0:
            self._status[index] = DONE
            return True
        return False

    def _count_finished(self, count: int) -> list[Callable[[], None]]:
        """Count `count` more requests finished (under the lock); once none is open, wake
        the waiters and hand back the on_finish callbacks to call."""
        self._open -= count
        if self._open:
            return []
        self._cond.notify_all()
        callbacks, self._callbacks = self._callbacks, []
        return callbacks


    def frame_started(self, sock: socket.socket) -> bool:
        """A frame of this batch starts moving bytes on `sock`; False when the batch was
        given up (the frame must not run)."""
        with self._cond:
            if self._given_up:
                return False
            self._running[id(sock)] = sock
            return True

    def copy_started(self, key: object) -> bool:
        """A memory copy of this batch (`key`: its own object) starts on a pool thread;
        False when the batch was given up (it must not run). A give-up waits for it to end
        (`frame_ended(key)`)."""
        with self._cond:
            if self._given_up:
                return False
            self._running[id(key)] = None
            return True

    def frame_ended(self, sock: object) -> None:
        with self._cond:
            if id(sock) in self._running:
                del self._running[id(sock)]
                if not self._running:
                    self._cond.notify_all()

    @property
    def failed(self) -> bool:
        """A request of the batch failed."""
        return self._failed

    def settle(self, timeout_s: float) -> bool:
        """After every request is decided: when one failed, stop the frames still moving
        bytes for the batch (a failed slice decides its request while its siblings still
        copy; queued ones would start later) before the caller's memory is its own again.
        False if a frame still ran after `timeout_s`."""
        with self._cond:
            if not self._failed:
                return True  # every request done: every frame ended before it was counted
            self._given_up = True
        return self._stop_frames(timeout_s)

    def give_up(self, reason: str, timeout_s: float) -> bool:
        """Fail the requests still open, once the frames still moving their bytes have
        stopped: their connections are shut down (a stalled peer that resumes must not land
        bytes in memory the caller reuses once this returns), and no queued frame starts.
        False if a frame still ran after `timeout_s`."""
        with self._cond:
            self._given_up = True
        self.fail_open(reason)  # first: the stopped frames' own failures come after it
        return self._stop_frames(timeout_s)

    def _stop_frames(self, timeout_s: float) -> bool:
        """Shut down the connections of the frames still running (no frame starts any more:
        `_given_up`) and wait up to `timeout_s` for them to end."""
        with self._cond:  # (a frame that ends meanwhile waits: no connection it handed
            for sock in self._running.values():  # back is shut down)
                if sock is not None:  # (a memory copy is waited for)
                    with contextlib.suppress(OSError):
                        sock.shutdown(socket.SHUT_RDWR)
            return self._cond.wait_for(lambda: not self._running, timeout_s)

    def fail_open(self, reason: str) -> None:
        """Mark every still-pending request failed (used on timeout and engine close)."""
        with self._cond:
            pending = [i for i, s in enumerate(self._status) if s.state == RequestState.PENDING]
        self.complete(pending, reason)

    def status(self) -> list[RequestStatus]:
        with self._cond:
            return list(self._status)

    @property
    def finished(self) -> bool:
        return self._open == 0

    def wait(self, timeout_s: float | None) -> bool:
        """True when every request finished, False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._open == 0, timeout_s)

    def on_finish(self, callback: Callable[[], None]) -> None:
        """Call `callback` (from a transport thread) once every request has finished."""
        with self._cond:
            if self._open:
                self._callbacks.append(callback)
                return
        callback()


def notify_done(on_done: Callable[[int], None], index: int) -> None:
    """Call a batch's on_done (or on_sent) hook; a failure in it is logged, never raised into
    the transport thread."""
    try:
        on_done(index)
    except Exception:
        log.warning("a transfer's on_done hook failed", exc_info=True)
