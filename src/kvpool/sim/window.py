"""The trace window whose offered load is most like the whole trace's.

A live run replays a short window of the hour; a window lighter than the hour shows smaller
gains than the paper's (the baselines meet the SLOs more often), a heavier one larger. The
window is judged on the three rates that set the load of a cluster: requests, prompt tokens
and output tokens per second. Its *deviation* is the largest relative gap between one of its
rates and the whole trace's; the representative window has the smallest.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass

from kvpool.errors import InvalidArgument
from kvpool.sim.trace import TraceRequest

STEP_S = 5.0
"""Candidate windows start every STEP_S seconds of the trace."""


@dataclass(frozen=True, slots=True)
class Rates:
    requests_per_s: float
    prompt_tokens_per_s: float
    output_tokens_per_s: float

    def deviation(self, whole: Rates) -> float:
        """Largest |self / whole - 1| over the three rates."""
        pairs = ((self.requests_per_s, whole.requests_per_s),
                 (self.prompt_tokens_per_s, whole.prompt_tokens_per_s),
                 (self.output_tokens_per_s, whole.output_tokens_per_s))
        return max(abs(a / b - 1.0) for a, b in pairs if b > 0)


@dataclass(frozen=True, slots=True)
class Window:
    start_s: float
    length_s: float
    rates: Rates
    whole: Rates
    deviation: float


def rates(reqs: Sequence[TraceRequest], length_s: float) -> Rates:
    return Rates(len(reqs) / length_s, sum(r.input_len for r in reqs) / length_s,
                 sum(r.output_len for r in reqs) / length_s)


def representative_window(trace: Sequence[TraceRequest], length_s: float,
                          step_s: float = STEP_S) -> Window:
    """The window of `length_s` seconds (starting on a multiple of `step_s`) whose rates
    deviate least from the whole trace's; the earliest among equals."""
    if not trace or length_s <= 0 or step_s <= 0:
        raise InvalidArgument("a window needs a non-empty trace and positive lengths")
    arrivals = [r.arrival_s for r in trace]
    first, last = arrivals[0], arrivals[-1]
    whole = rates(trace, max(last - first, 1e-9))
    best: Window | None = None
    for i in range(max(0, int((last - first - length_s) // step_s)) + 1):
        start = first + i * step_s
        inside = trace[bisect_left(arrivals, start):bisect_left(arrivals, start + length_s)]
        mine = rates(inside, length_s)
        dev = mine.deviation(whole)
        if best is None or dev < best.deviation - 1e-12:
            best = Window(start, length_s, mine, whole, dev)
    assert best is not None
    return best


def describe(w: Window) -> str:
    """One line: where the window is and how its rates compare with the whole trace's."""
    r, h = w.rates, w.whole
    return (f"window t = {w.start_s:.0f} s + {w.length_s:.0f} s: {r.requests_per_s:.2f} req/s, "
            f"{r.prompt_tokens_per_s:.0f} prompt and {r.output_tokens_per_s:.0f} output tokens/s "
            f"(whole trace {h.requests_per_s:.2f}, {h.prompt_tokens_per_s:.0f}, "
            f"{h.output_tokens_per_s:.0f}: largest deviation {100 * w.deviation:.1f}%)")
