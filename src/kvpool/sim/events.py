"""A minimal discrete-event loop on virtual time."""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any

from kvpool.errors import InvalidArgument


class EventLoop:
    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = 0
        self.now = 0.0
        self.num_events = 0
        self.after_each: Callable[[], None] | None = None
        """Called after every event (tests hook integrity checks here)."""

    def at(self, when: float, fn: Callable[..., None], *args: Any) -> None:
        """Run `fn(*args)` at time `when`; same-time events run in scheduling order."""
        if when < self.now - 1e-9:
            raise InvalidArgument(f"cannot schedule in the past ({when} < {self.now})")
        self._seq += 1
        heapq.heappush(self._heap, (max(when, self.now), self._seq, fn, args))

    def run(self, until: float | None = None) -> None:
        while self._heap:
            when, _, fn, args = self._heap[0]
            if until is not None and when > until:
                break
            heapq.heappop(self._heap)
            self.now = when
            self.num_events += 1
            fn(*args)
            if self.after_each is not None:
                self.after_each()
