"""The metric of [A] §8.1: the highest Poisson request rate at which P90 TTFT and P90 TBT
both stay within their limits, and the limits themselves.

Limits ([A] §2: 10x and 5x the value of a single request served alone without interference),
one pair per workload, the same for every system compared:
- TTFT limit = 10 x `cost.prefill_s(n)`: a cold prefill of the workload's mean input n (no
  reuse, no queue; the first token of a lone Mooncake request also comes at the end of its
  prefill, the KV of a lone request streaming behind it);
- TBT limit = 5 x the TBT of a lone request of mean output m on a Mooncake decode instance:
  its steps take `cost.decode_step_s(1, n)`, and the step in which it joins takes
  `cost.decode_join_s` longer, spread over the gaps the statistic averages: all m - 1 of them
  for [A]'s mean time between tokens ("mean", the default of these experiments: [A] states
  its TBT limit in s/token), or k = ceil(0.1 (m - 1)) for [F]'s mean of the longest 10%
  ("top10"). A colocated instance pays no join cost, so this is the larger of the systems'
  lone values: no system breaks its limits when served alone.

Search (`find_max_rps`): one fixed request list and one arrival seed, so two rates differ only
in the scale of the arrival times; the rate grows (or shrinks) by `factor` from `start_rps`
until the outcome flips, then `bisect_steps` log-space bisections narrow the bracket. The
result is the highest passing rate probed and its measurement.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kvpool.conductor import CostModel
from kvpool.conductor.decode import top_gaps
from kvpool.errors import InvalidArgument
from kvpool.sim.metrics import SimResult
from kvpool.sim.record import TBT_STATS
from kvpool.sim.synth import with_rate
from kvpool.sim.trace import TraceRequest

TTFT_FACTOR = 10.0
TBT_FACTOR = 5.0
System = Callable[[Sequence[TraceRequest]], SimResult]
"""Runs one list of requests on a system and returns its result."""


@dataclass(frozen=True, slots=True)
class SloLimits:
    ttft_s: float
    tbt_s: float
    stat: str = "mean"
    """How each request's TBT is summarised before the P90 (record.TBT_STATS)."""


def lone_limits(cost: CostModel, input_len: int, output_len: int,
                stat: str = "mean") -> SloLimits:
    """10x the lone TTFT and 5x the lone TBT (by `stat`) of a request of `input_len` /
    `output_len` tokens (module docstring)."""
    if input_len < 1 or output_len < 2 or stat not in TBT_STATS:
        raise InvalidArgument(f"need input_len >= 1, output_len >= 2 and a statistic in "
                              f"{TBT_STATS}, got {input_len}, {output_len}, {stat!r}")
    gaps = output_len - 1
    spread = gaps if stat == "mean" else top_gaps(gaps)
    tbt = cost.decode_step_s(1, input_len) + cost.decode_join_s / spread
    return SloLimits(TTFT_FACTOR * cost.prefill_s(input_len), TBT_FACTOR * tbt, stat)


@dataclass(frozen=True, slots=True)
class SearchSpec:
    start_rps: float = 0.05
    factor: float = 2.0
    bisect_steps: int = 5
    min_rps: float = 1e-3
    max_rps: float = 100.0
    seed: int = 0
    """Seed of the Poisson arrivals."""

    def __post_init__(self) -> None:
        if not 0 < self.min_rps <= self.start_rps <= self.max_rps or self.factor <= 1:
            raise InvalidArgument(f"need 0 < min_rps <= start_rps <= max_rps, factor > 1: {self}")
        if self.bisect_steps < 0:
            raise InvalidArgument(f"bisect_steps must be >= 0, got {self.bisect_steps}")


@dataclass(frozen=True, slots=True)
class Point:
    rps: float
    p90_ttft_s: float
    p90_tbt_s: float
    ok: bool


def measure(system: System, reqs: Sequence[TraceRequest], rps: float, limits: SloLimits,
            seed: int = 0) -> Point:
    """P90 TTFT and TBT over all requests of one run at `rps` (an unfinished request counts
    as missing both limits)."""
    res = system(with_rate(reqs, rps, seed))
    ttft, tbt = _p90(res.ttfts(), len(reqs)), _p90(res.tbts(limits.stat), len(reqs))
    return Point(rps, ttft, tbt, ttft <= limits.ttft_s and tbt <= limits.tbt_s)


def _p90(values: np.ndarray, total: int) -> float:
    """P90 of `values` padded with infinities to `total` (inf where it falls among them)."""
    if not total:
        return math.inf
    padded = np.concatenate([values, np.full(total - values.size, np.inf)])
    with np.errstate(invalid="ignore"):
        value = float(np.percentile(padded, 90))
    return math.inf if math.isnan(value) else value


def find_max_rps(probe: Callable[[float], Point], spec: SearchSpec = SearchSpec()
                 ) -> tuple[Point | None, list[Point]]:
    """(the highest passing point, every point probed); None when even `min_rps` fails."""
    seen = [probe(spec.start_rps)]
    lo, hi = _bracket(probe, spec, seen)
    for _ in range(spec.bisect_steps if lo is not None and hi is not None else 0):
        assert lo is not None and hi is not None
        mid = probe(math.sqrt(lo.rps * hi.rps))
        seen.append(mid)
        lo, hi = (mid, hi) if mid.ok else (lo, mid)
    return lo, seen


def _bracket(probe: Callable[[float], Point], spec: SearchSpec,
             seen: list[Point]) -> tuple[Point | None, Point | None]:
    """(last pass, first fail) of the geometric walk from the start point."""
    step = spec.factor if seen[0].ok else 1 / spec.factor
    while True:
        last = seen[-1]
        rps = last.rps * step
        if not spec.min_rps <= rps <= spec.max_rps:
            return (last, None) if last.ok else (None, last)
        nxt = probe(rps)
        seen.append(nxt)
        if nxt.ok != last.ok:
            return (last, nxt) if last.ok else (nxt, last)
