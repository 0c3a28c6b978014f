"""One watcher per streamed leg: a worker that leaves the rotation cuts the read in progress.

Racing each read against the worker's `down` event with two tasks, a wait and a cancel (as the
proxy once did) was its largest single cost per relayed token. With a `LegWatch` per leg
instead, the proxy's CPU per relayed SSE chunk fell from 144-181 to 115-135 us (`kvpool up
--engine emulated --speed-up 1000`, 100 streams of 256 tokens, before and after alternating
in one run). A single call (the prefill leg) is `watched`. It is subscribed to `down` (a
callback, no task) for the whole leg and, only while a read is in progress (`read`), cancels
the reading task when it fires, as `asyncio.timeout` does:

    leg starts       -> subscribed to worker.down (a callback, no task per leg or token)
    read(anext(...)) -> the task is armed; `down` fires -> task.cancel() -> the read ends
                        with WorkerCallError instead of CancelledError (uncancel())
    between reads    -> `down` fires -> the next read raises WorkerCallError at once
    leg ends         -> close(): unsubscribed

A cancellation from elsewhere (the client went away) stays a CancelledError.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from kvpool.errors import WorkerCallError
from kvpool.serve.cluster import WorkerState

T = TypeVar("T")

OUT_OF_ROTATION = "worker is out of rotation"
STOPPED_ANSWERING = "worker stopped answering its health checks"


class LegWatch:
    """Watches `worker` for one leg's reads (`call` names the leg in errors)."""

    def __init__(self, worker: WorkerState, call: str) -> None:
        self.worker, self.call = worker, call
        self._reader: asyncio.Task[object] | None = None
        self._fired = False
        self._loop: asyncio.AbstractEventLoop | None = None
        """The leg's loop, asked once (each ask is a getpid() system call on Python 3.11)."""
        worker.down.subscribe(self._on_down)

    def _on_down(self) -> None:
        self._fired = True
        if self._reader is not None:
            self._reader.cancel()

    async def read(self, aw: Awaitable[T]) -> T:
        """`await aw`, unless the worker leaves the rotation first or meanwhile
        (WorkerCallError); `aw` has ended either way."""
        if self._fired or self.worker.down.is_set():
            _close(aw)
            raise WorkerCallError(self.worker.url, self.call, OUT_OF_ROTATION)
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        reader = asyncio.current_task(self._loop)
        assert reader is not None
        self._reader = reader
        try:
            return await aw
        except asyncio.CancelledError:
            if self._fired and reader.uncancel() == 0:
                raise WorkerCallError(self.worker.url, self.call, STOPPED_ANSWERING) from None
            raise
        finally:
            self._reader = None

    def close(self) -> None:
        self.worker.down.unsubscribe(self._on_down)


def _close(aw: Awaitable[object]) -> None:
    """Close a coroutine never awaited (no 'never awaited' warning, nothing left running)."""
    close = getattr(aw, "close", None)
    if close is not None:
        close()


async def watched(aw: Awaitable[T], worker: WorkerState, call: str) -> T:
    """`await aw` as one read of a leg of its own: WorkerCallError if `worker` leaves the
    rotation first or meanwhile."""
    watch = LegWatch(worker, call)
    try:
        return await watch.read(aw)
    finally:
        watch.close()
