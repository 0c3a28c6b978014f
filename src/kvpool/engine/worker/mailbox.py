"""Step outputs from the engine thread to the event loops that wait for them: one wake-up per
engine step, however many requests and tokens the step served.

    engine thread:  listener(outputs of one request in one step) -> pending   (no wake-up)
                    flush() once the step's outputs are all handed out  -> one
                    call_soon_threadsafe per event loop with waiting requests
    event loop:     each request's queue (`StepQueue`) gets its step's outputs as one list

Handing each output over with its own `call_soon_threadsafe` woke the event loop (a write to
its self-pipe) once per token per request: 13% of the emulated worker's CPU per token in
`kvpool bench proxy`. `listener` and `flush` run on the engine thread only (EngineLoop calls
them); `_deliver` on the event loop.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

from kvpool.engine.core import StepOutput

Outputs = list[StepOutput]


class StepQueue:
    """One request's step outputs on its event loop, for its one reader: asyncio.Queue's
    `put_nowait`, `get`, `get_nowait` and `empty`, without its loop lookup per wait (a
    getpid() system call each on Python 3.11: one per request per engine step) or its
    bookkeeping for several getters and a bound. A cancelled `get` leaves the outputs."""

    __slots__ = ("_loop", "_items", "_waiter")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._items: deque[Outputs] = deque()
        self._waiter: asyncio.Future[None] | None = None

    def put_nowait(self, outputs: Outputs) -> None:
        self._items.append(outputs)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self) -> Outputs:
        while not self._items:
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.popleft()

    def get_nowait(self) -> Outputs:
        return self._items.popleft()  # IndexError when empty

    def empty(self) -> bool:
        return not self._items



class StepMailbox:
    def __init__(self) -> None:
        self._pending: list[tuple[asyncio.AbstractEventLoop, StepQueue, Outputs]] = []

    def listener(self, loop: asyncio.AbstractEventLoop,
                 queue: StepQueue) -> Callable[[Outputs], None]:
        """A request's listener: its outputs of a step go to `queue` (on `loop`) at the next
        `flush`."""
        def put(outputs: Outputs) -> None:
            self._pending.append((loop, queue, outputs))
        return put

    def flush(self) -> None:
        """Hand every pending list to its event loop: one wake-up per loop. A loop that has
        closed meanwhile (the server stopping) drops its lists."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[StepQueue, Outputs]]] = {}
        for loop, queue, outputs in pending:
            by_loop.setdefault(loop, []).append((queue, outputs))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # the loop is closed: nobody waits for these any more
                pass


def _deliver(items: list[tuple[StepQueue, Outputs]]) -> None:
    for queue, outputs in items:
        queue.put_nowait(outputs)
