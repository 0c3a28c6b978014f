"""The cyclic garbage collector's pauses in this process, timed through `gc.callbacks`: per
generation, how many collections ran and how long each held the interpreter.

Python runs its collector once enough container objects were made; a run holds the GIL, so
every thread of the process waits while it walks the generation's objects. In a serving
process each run is a stall in every stream in flight, and the runs together a share of its
CPU (`metadata.http_serving.SERVING_GC_THRESHOLDS`). The proxy exports them
(`kvpool_proxy_gc_pause_seconds`, a histogram by generation) and `kvpool bench proxy` reads
them per request.

    pauses = GcPauses.installed()     # the process's own, its callback added once
    pauses.counts[2], pauses.sums[2]  # generation 2: pauses by bucket, seconds in all

Callbacks never overlap: the collector does not start another run until its callbacks of
the last have returned, whichever thread triggered it.
"""

from __future__ import annotations

import gc
import time
from bisect import bisect_left
from collections.abc import Callable
from typing import Any, ClassVar

BUCKETS = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0)
"""Upper bounds of the pause histogram, seconds (a young collection takes 0.1-3 ms here, a
full one over a large heap tens of ms)."""
GENERATIONS = 3


class GcPauses:
    _process: ClassVar[GcPauses | None] = None

    def __init__(self, now: Callable[[], float] = time.perf_counter) -> None:
        self._now = now
        self.bounds = (*BUCKETS, float("inf"))
        self.counts = [[0] * len(self.bounds) for _ in range(GENERATIONS)]
        """Pauses of each generation by bucket (a pause goes in the first whose bound is
        >= it, as prometheus_client's histograms count)."""
        self.sums = [0.0] * GENERATIONS
        self._started: float | None = None

    @classmethod
    def installed(cls) -> GcPauses:
        """The process's pauses, timed from the first call on."""
        if cls._process is None:
            cls._process = cls()
            gc.callbacks.append(cls._process.on_gc)
        return cls._process

    def on_gc(self, phase: str, info: dict[str, Any]) -> None:
        """A `gc.callbacks` callback."""
        if phase == "start":
            self._started = self._now()
            return
        started, self._started = self._started, None
        if started is None:  # installed during a collection
            return
        pause, gen = self._now() - started, int(info["generation"])
        self.counts[gen][bisect_left(self.bounds, pause)] += 1
        self.sums[gen] += pause
