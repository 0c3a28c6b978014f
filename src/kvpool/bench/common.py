"""Shared pieces of the benchmarks: timing loops, child processes, result rows and tables."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

from kvpool.units import format_size


@dataclass
class Measurement:
    bench: str
    impl: str
    """Who was measured: kvpool, mooncake, raw-socket, memcpy."""
    transport: str
    op: str
    mode: str
    """single (one request per call) or batched."""
    size_bytes: int
    gb_per_s: float
    req_per_s: float
    anchor: str | None = None
    ratio: float | None = None
    """gb_per_s / the anchor's gb_per_s in the same run."""

    def row(self) -> str:
        ratio = f"{self.ratio:6.2f}x {self.anchor}" if self.ratio is not None else ""
        return (f"{self.impl:<10} {self.transport:<5} {self.op:<5} {self.mode:<7} "
                f"{format_size(self.size_bytes):>8} {self.gb_per_s:8.2f} GB/s "
                f"{self.req_per_s:11,.0f} req/s  {ratio}")


WARM_UP_S = 0.05
"""Untimed calls before each timed loop. On the bench VM a CPU that sat idle for a while runs
the next 20-50 ms of work up to twice as slowly (its clock and the host's scheduling ramp up
again): a timed loop of a few milliseconds right after a pause measured that ramp, not the
code (docs/perf.md)."""


def warm_up(fn: Callable[[], object], seconds: float = WARM_UP_S) -> None:
    """Call fn at least once and until `seconds` have passed, untimed."""
    end = time.perf_counter() + seconds
    fn()
    while time.perf_counter() < end:
        fn()


def time_calls(fn: Callable[[], object], min_time_s: float, min_calls: int = 3) -> tuple[int, float]:
    """Call fn repeatedly (after warm_up) for at least min_time_s; (calls, seconds)."""
    warm_up(fn)
    calls, start = 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        elapsed = time.perf_counter() - start
        if elapsed >= min_time_s and calls >= min_calls:
            return calls, elapsed


def rate(fn: Callable[[], object], bytes_per_call: int, reqs_per_call: int, min_time_s: float) -> tuple[float, float]:
    calls, elapsed = time_calls(fn, min_time_s)
    return bytes_per_call * calls / elapsed / 1e9, reqs_per_call * calls / elapsed


@contextmanager
def child(module: str, *args: str) -> Iterator[dict[str, Any]]:
    """Run `python -m module args`, yield the JSON line it announces, stop it on exit."""
    proc = subprocess.Popen([sys.executable, "-m", module, *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{module} {' '.join(args)} exited before announcing itself")
        yield json.loads(line)
    finally:
        if proc.stdin:
            proc.stdin.close()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def emit(results: list[Measurement], as_json: bool) -> None:
    for m in results:
        print(json.dumps(asdict(m)) if as_json else m.row(), flush=True)


def goal_line(met: bool, text: str) -> str:
    """One line of a benchmark's goals: met, or MISS."""
    return f"  {'met ' if met else 'MISS'}  {text}"


def print_goals(lines: list[str], of: str = "ratios of medians within this run") -> None:
    """A benchmark's goal lines under their heading (nothing when there are none)."""
    if lines:
        print(f"\ngoals ({of}):")
        print("\n".join(lines))
