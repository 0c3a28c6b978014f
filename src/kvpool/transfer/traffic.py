"""Counts of what the router sent down each route, per target segment.

A request is counted when the router hands it to a transport (local copy, shm or tcp), with
its length, whatever its outcome: the counts say which way bytes were meant to go, which is
what a test of the routing (tcp between hosts, shm within one) asks.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

ROUTES = ("local", "shm", "tcp")


@dataclass(frozen=True)
class RouteCount:
    num_requests: int = 0
    num_bytes: int = 0


class Traffic:
    """The only writer of its counts; `snapshot` hands out a copy."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[tuple[str, str], list[int]] = {}

    def add(self, route: str, target: str, num_requests: int, num_bytes: int) -> None:
        assert route in ROUTES, route
        with self._lock:
            count = self._counts.setdefault((route, target), [0, 0])
            count[0] += num_requests
            count[1] += num_bytes

    def snapshot(self) -> dict[str, dict[str, RouteCount]]:
        """route -> target segment -> counts; routes never taken are absent."""
        with self._lock:
            items = [(key, tuple(count)) for key, count in self._counts.items()]
        out: dict[str, dict[str, RouteCount]] = {}
        for (route, target), (num_requests, num_bytes) in items:
            out.setdefault(route, {})[target] = RouteCount(num_requests, num_bytes)
        return out
