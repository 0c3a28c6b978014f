"""Busy polling: wait for a socket's next bytes by polling it for a short while before
blocking, on connections where the next bytes usually come soon.

Why: a process blocked in recv() sleeps, and on a virtual machine its idle vCPU halts;
waking it again is the most expensive step of a small round trip. On the 2-core bench VM a
Python TCP ping-pong of 64 bytes takes 78 us per round trip when both sides block, 27 us
when the side waiting for a reply polls, and 7 us when both do (docs/perf.md). A store get
is two such round trips (master, then the node holding the bytes), so this is most of its
latency. On bare metal the gain is smaller; polling never adds latency.

Polling is polite: between attempts the thread calls sched_yield(), so a process that is
runnable on the same CPU (often the very peer that must answer) runs first; each attempt
is a syscall, so other threads of the process get the GIL; and at most half the CPUs'
worth of a process's threads poll at once.

Polling stands aside on a crowded machine: when a thread lost its CPU for longer than
CROWDED_GAP_S between two attempts, other processes hold the CPUs (the peer's own turn
takes far less), and every further yield would hand them a whole time slice (milliseconds).
Every window of the process then blocks at once for CROWDED_PAUSE_S (crowding is the
machine's, so one thread's finding holds for all) before polling again: under a load of
other work a blocked thread is woken ahead of the CPU hogs, a yielding one waits behind them
(docs/perf.md, "A crowded machine").

Policy: `PollWindow` decides how long to poll. Mechanism: `recv_polling`,
`recv_into_polling`, `select_polling` and the general `polled` poll for that long, then
block as before, and tell the window how long the wait was.
"""

from __future__ import annotations

import os
import selectors
import socket
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from kvpool.errors import ConfigError

_DONTWAIT = socket.MSG_DONTWAIT
_clock = time.perf_counter
_yield = os.sched_yield
T = TypeVar("T")
_NOTHING = object()
_SLOTS = tuple(threading.Lock() for _ in range(max(1, (os.cpu_count() or 2) // 2)))
"""At most this many threads of a process poll at once (half the CPUs): a target with many
busy connections has a thread per connection, and more pollers than that would take the
CPUs their peers need. A thread that finds every slot taken blocks at once."""


MAX_WINDOW_US = 100_000


class Crowd:
    """This process's view of a crowded machine (one per process: CROWD)."""

    __slots__ = ("resume_at", "pauses")

    def __init__(self) -> None:
        self.resume_at = 0.0
        """perf_counter time from which windows poll again (0: they may now)."""
        self.pauses = 0
        """Times polling stood aside for a crowded machine."""

    def seen(self, now: float, pause_s: float | None = None) -> None:
        """A wait lost its CPU to other work at `now`: no polling for `pause_s` (default
        CROWDED_PAUSE_S)."""
        self.resume_at = now + (CROWDED_PAUSE_S if pause_s is None else pause_s)
        self.pauses += 1


CROWD = Crowd()
CROWDED_GAP_S = 0.001
"""Two attempts this far apart: the CPU went to other work for about a scheduler time slice
(a sched_yield with only the peer to run returns within tens or hundreds of microseconds)."""
CROWDED_PAUSE_S = 0.25
"""How long a window that saw a crowded machine blocks at once before it polls again (one
lost time slice per pause while the crowd lasts)."""


def check_window_us(name: str, window_us: int) -> None:
    """ConfigError unless `window_us` is a poll window (0..MAX_WINDOW_US microseconds)."""
    if not 0 <= window_us <= MAX_WINDOW_US:
        raise ConfigError(f"{name} must be in [0, {MAX_WINDOW_US}] us, got {window_us}")


class PollWindow:
    """How long to poll before blocking, learned from the waits seen on one connection (or
    loop): the window while waits end within it (a busy stream of requests or replies), none
    after a wait that outlasted it (an idle connection costs no CPU), until a wait that
    ends within it again. A window of 0 never polls. Not thread-safe: one per reader."""

    __slots__ = ("window_s", "_hot")

    def __init__(self, window_us: int) -> None:
        check_window_us("a poll window", window_us)
        self.window_s = window_us / 1e6
        self._hot = window_us > 0

    def budget_s(self) -> float:
        """Seconds to poll before blocking on the next wait (none while CROWD pauses)."""
        if not self._hot:
            return 0.0
        resume = CROWD.resume_at
        if resume:
            if _clock() < resume:
                return 0.0
            CROWD.resume_at = 0.0
        return self.window_s

    def observe(self, waited_s: float) -> None:
        """A wait that ended after `waited_s` (polling or blocked)."""
        self._hot = 0.0 < self.window_s and waited_s <= self.window_s


NEVER = PollWindow(0)
"""The window of a reader that always blocks at once."""


def recv_polling(sock: socket.socket, nbytes: int, window: PollWindow) -> bytes:
    """`sock.recv(nbytes)`, polled for the window's budget first. Raises what recv raises
    (BlockingIOError when a blocking socket's SO_RCVTIMEO ran out)."""
    return polled(lambda: sock.recv(nbytes, _DONTWAIT), lambda: sock.recv(nbytes), window)


def recv_into_polling(sock: socket.socket, view: memoryview, window: PollWindow) -> int:
    """`sock.recv_into(view)`, polled for the window's budget first; as recv_polling."""
    return polled(lambda: sock.recv_into(view, 0, _DONTWAIT), lambda: sock.recv_into(view),
                   window)


def polled(attempt: Callable[[], T], block: Callable[[], T], window: PollWindow) -> T:
    """`attempt()` (a read without waiting, raising BlockingIOError while there is nothing)
    again and again for the window's budget, then `block()`."""
    budget = window.budget_s()
    start = _clock()
    slot = _free_slot() if budget else None
    got = _NOTHING
    if slot is not None:
        try:
            end = last = start
            end += budget
            while True:
                try:
                    got = attempt()
                except BlockingIOError:
                    pass
                now = _clock()
                if now - last > CROWDED_GAP_S:
                    CROWD.seen(now)
                    break
                if got is not _NOTHING or now > end:
                    break
                last = now
                _yield()
        finally:
            slot.release()
    if got is _NOTHING:
        got = block()
    window.observe(_clock() - start)
    return got  # type: ignore[return-value]


def _free_slot() -> threading.Lock | None:
    """A polling slot now held by this thread, or None when all are taken."""
    for slot in _SLOTS:
        if slot.acquire(False):
            return slot
    return None


def select_polling(sel: selectors.BaseSelector, timeout_s: float,
                   window: PollWindow) -> list[tuple[selectors.SelectorKey, int]]:
    """`sel.select(timeout_s)`, polled (select with no wait) for the window's budget first.
    A wait that ends with nothing ready after at least the window cools it."""
    budget = min(window.budget_s(), timeout_s)
    start = _clock()
    slot = _free_slot() if budget else None
    ready = []
    if slot is not None:
        try:
            end = last = start
            end += budget
            while True:
                ready = sel.select(0)
                now = _clock()
                if now - last > CROWDED_GAP_S:
                    CROWD.seen(now)
                    break
                if ready or now > end:
                    break
                last = now
                _yield()
        finally:
            slot.release()
    if not ready:
        ready = sel.select(max(0.0, timeout_s - (_clock() - start)))
    if ready:
        window.observe(_clock() - start)
    elif timeout_s >= window.window_s:  # idle for longer than the window
        window.observe(float("inf"))
    return ready
