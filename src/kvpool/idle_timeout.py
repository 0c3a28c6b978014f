"""A timeout for an await that repeats (a stream's reads, a request's queue of outputs), with
one timer alive at a time instead of one per await.

`asyncio.timeout` (and `wait_for`) makes and cancels a timer at every await: about 5 us each on
uvloop, a tenth of what the proxy spends per relayed token, and as much again in a worker per
request per engine step. Here an await records when it began; one timer, set at the first
await, fires `limit_s` later and either ends the await in progress (it has waited that long:
TimeoutError) or is set again for when that await would time out. Between awaits it lapses;
the next await sets it. So a stream of frames 10 ms apart pays for one timer per `limit_s`.

    deadline = IdleTimeout()
    data = await deadline.wait(reader.read(n), 30.0)   # TimeoutError after 30 s of silence
    deadline.close()                                     # when the stream is done

Only one await at a time (one task reading the stream). A cancel from elsewhere stays a
CancelledError, and a task already being cancelled when it awaits still gets its TimeoutError,
as with `asyncio.timeout` (which the cancel counts follow: `uncancel` against the count on
entry).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


class IdleTimeout:
    __slots__ = ("_loop", "_task", "_started", "_limit", "_timer", "_due", "_expired")

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        """The loop of the first await (the stream's): asked once, as asking the running
        loop costs a getpid() system call each time on Python 3.11."""
        self._task: asyncio.Task[object] | None = None
        """The task whose await is in progress (None between awaits)."""
        self._started = self._limit = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._due = 0.0
        """When the timer fires (loop time)."""
        self._expired = False

    async def wait(self, aw: Awaitable[T], limit_s: float) -> T:
        """`await aw`, or TimeoutError once it has waited `limit_s`. A timer set for a later
        time (an earlier, longer limit) is set again for this one's."""
        loop = self._loop or self._bind()
        task = asyncio.current_task(loop)
        assert task is not None
        self._task, self._started, self._limit, self._expired = task, loop.time(), limit_s, False
        due = self._started + limit_s
        if self._timer is None or self._due > due:
            self._arm(loop, due)
        entered = task.cancelling()
        try:
            return await aw
        except asyncio.CancelledError:
            if self._expired:
                self._expired = False
                if task.uncancel() <= entered:
                    raise TimeoutError(f"nothing within {limit_s} s") from None
            raise
        finally:
            self._task = None
            if self._expired:  # `aw` swallowed the timer's cancel: take it back
                self._expired = False
                task.uncancel()

    def touch(self) -> None:
        """What the await in progress waits for moved on without ending it (a stream's bytes
        taken in the transport's callback): its `limit_s` counts from now."""
        if self._task is not None and self._loop is not None:
            self._started = self._loop.time()

    def _arm(self, loop: asyncio.AbstractEventLoop, due: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._due = loop.call_at(due, self._fire), due

    def _fire(self) -> None:
        self._timer = None
        task = self._task
        if task is None:  # no await in progress: the next one sets the timer again
            return
        due = self._started + self._limit
        loop = self._loop or self._bind()
        if loop.time() >= due:
            self._expired = True
            task.cancel()
        else:
            self._arm(loop, due)

    def _bind(self) -> asyncio.AbstractEventLoop:
        self._loop = asyncio.get_running_loop()
        return self._loop

    @property
    def armed(self) -> bool:
        """A timer is set (from the first await until it lapses or `close`)."""
        return self._timer is not None

    def close(self) -> None:
        """Drop the timer (the awaits are over)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
