"""Busy polling for an asyncio event loop: while events come closer together than a window,
the loop checks its sockets without sleeping, instead of blocking in epoll until the next.

Why (as kvpool.busypoll, for blocking sockets): a process that sleeps lets its CPU go idle,
and on a virtual machine an idle vCPU halts; waking it again, with cold caches, is the most
expensive step of handling a reply that comes soon. The proxy at concurrency 1 spends most of
the time it adds to a request in such wake-ups: its request to the worker, each frame of the
stream, and the client's next request each find it asleep (docs/serve.md, "Polling the loop").

Policy: a window (`window_us`, 0 = never poll). Each event (`kick()`: a request arrives, a
stream's frames are read) starts, or extends, a stretch of polling that ends `window_us` after
the last event: events that come that close together (a stream's frames, a request and its
worker's first reply) find the loop awake; after a longer silence the loop blocks as before,
so an idle proxy, or one waiting on slow engine steps, costs no more than a window per event.
A stretch stands aside for a crowded machine (busypoll.CROWD): a turn that did not come back
within busypoll.CROWDED_GAP_S (other processes held the CPU, or the loop itself was that busy,
when polling gains nothing either) pauses every poller of the process for
busypoll.CROWDED_PAUSE_S. And nothing polls while `busy()` (the proxy: more than a few
requests in flight, whose events keep the loop awake anyway).

Mechanism: one task per loop. During a stretch it yields to the loop with `sleep(0)` (a
callback is then ready, so the loop polls its sockets with no timeout and runs what came)
and the CPU with sched_yield() between turns (a peer on the same CPU runs first); between
stretches it waits for the next kick.

    poller = LoopPoller(300)
    poller.start()              # on the loop
    poller.kick()               # on each event (cheap: a clock read, an event set now and then)
    await poller.stop()
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable

from kvpool import busypoll
from kvpool.busypoll import check_window_us

_yield = os.sched_yield


class LoopPoller:
    __slots__ = ("window_s", "stretches", "_busy", "_clock", "_last", "_wake", "_polling",
                 "_task")

    def __init__(self, window_us: int, busy: Callable[[], bool] = lambda: False,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        check_window_us("the loop's poll window", window_us)
        self.window_s = window_us / 1e6
        self._busy = busy
        """True while the loop has so much in flight that its events keep it awake anyway:
        no polling then (it would spin through gaps too short to be worth it, at a cost)."""
        self.stretches = 0
        """Stretches of polling so far."""
        self._clock = clock
        self._last = float("-inf")
        """When the last event came (the clock's time)."""
        self._wake: asyncio.Event | None = None
        self._polling = False
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start polling on the running loop (nothing with a window of 0)."""
        if self.window_s > 0 and self._task is None:
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        task, self._task, self._wake = self._task, None, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    def kick(self) -> None:
        """An event: keep the loop polling until a window after it."""
        now = self._clock()
        self._last = now
        wake = self._wake
        if wake is not None and not self._polling and now >= busypoll.CROWD.resume_at \
                and not self._busy():
            wake.set()

    async def _run(self) -> None:
        wake = self._wake
        assert wake is not None
        while True:
            await wake.wait()
            wake.clear()
            self._polling = True
            self.stretches += 1
            try:
                await self._stretch()
            finally:
                self._polling = False

    async def _stretch(self) -> None:
        clock, window, crowd, busy = self._clock, self.window_s, busypoll.CROWD, self._busy
        turn = clock()
        while turn - self._last <= window and turn >= crowd.resume_at and not busy():
            await asyncio.sleep(0)
            now = clock()
            if now - turn > busypoll.CROWDED_GAP_S:
                crowd.seen(now)
                return
            turn = now
            _yield()
