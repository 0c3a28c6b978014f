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
when polling gains nothing either) pauses every poller of the process for CROWDED_PAUSE_S,
shorter than the sockets' pause: a request at low load lasts milliseconds, and a quarter of a
second would sit out dozens of them for one lost time slice (on this 2-core machine, where the
proxy, its worker and the client share the cores, that cost most of the gain). And nothing
polls while more than `max_in_flight` requests are in flight (`load.in_flight`), whose events
keep the loop awake anyway.

Mechanism: one task per loop. During a stretch it yields to the loop with `sleep(0)` (a
callback is then ready, so the loop polls its sockets with no timeout and runs what came)
and the CPU with sched_yield() between turns (a peer on the same CPU runs first); between
stretches it waits for the next kick.

    poller = LoopPoller(1000, cluster, 4)   # cluster.in_flight: requests in flight
    poller.start()                          # on the loop
    poller.kick()                           # on each event (a count, most of the time)
    await poller.stop()
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from typing import Protocol

from kvpool import busypoll
from kvpool.busypoll import check_window_us

_yield = os.sched_yield
CROWDED_PAUSE_S = 0.02
"""How long a turn that lost the CPU stops the loop's polling (busypoll.CROWDED_PAUSE_S for
the sockets' waits)."""


class InFlight(Protocol):
    in_flight: int
    """Requests in flight (the proxy: its LiveCluster's own bookings not yet finished)."""


class LoopPoller:
    __slots__ = ("window_s", "max_in_flight", "stretches", "_load", "_clock", "_events",
                 "_wake", "_polling", "_task")

    def __init__(self, window_us: int, load: InFlight, max_in_flight: int,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        check_window_us("the loop's poll window", window_us)
        self.window_s = window_us / 1e6
        self.max_in_flight = max_in_flight
        """With more requests in flight than this the loop does not poll: their events keep
        it awake anyway, and it would spin through gaps too short to be worth their CPU."""
        self.stretches = 0
        """Stretches of polling so far."""
        self._load, self._clock = load, clock
        self._events = 0
        """Kicks so far: a stretch sees a new one at its next turn (kick reads no clock)."""
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
        """An event: keep the loop polling until a window after it. Called per read of a
        stream: a count while a stretch runs, two attribute reads while many requests are in
        flight."""
        self._events += 1
        if self._polling or self._wake is None or self._load.in_flight > self.max_in_flight:
            return
        if self._clock() >= busypoll.CROWD.resume_at:
            self._wake.set()

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
        clock, window, crowd, load = self._clock, self.window_s, busypoll.CROWD, self._load
        turn = last = clock()
        seen = self._events
        while turn - last <= window and turn >= crowd.resume_at \
                and load.in_flight <= self.max_in_flight:
            await asyncio.sleep(0)
            now = clock()
            if now - turn > busypoll.CROWDED_GAP_S:
                crowd.seen(now, CROWDED_PAUSE_S)
                return
            turn = now
            if self._events != seen:  # kicked since the last turn: the window starts again
                seen, last = self._events, now
            _yield()
