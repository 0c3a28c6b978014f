"""What would put a figure that misses the paper at the paper's value: one named assumption,
swept.

A gain outside the 25% tolerance and outside kvpool's band (experiments/band.py) is paired
with the one assumption the papers do not measure that moves it (`Assumption`: a name, the
grid of its values, and the value kvpool ships). The experiment reruns on each grid value
(only the systems the assumption touches) and `reach` reports, for each such gain, the value
at which kvpool's figure would equal the paper's: linear interpolation between the two
neighbouring grid values whose figures bracket the paper's (the one nearest the shipped value
when several do), or none when no grid value reaches it, with the range the grid gives.

Every number is computed from the runs; the report (`kvpool sim experiment all`) prints it
beside the verdict (suite.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from kvpool.conductor.cost import CostModel
from kvpool.sim.experiments.verdicts import verdict


@dataclass(frozen=True, slots=True)
class Assumption:
    name: str
    """Short name, printed beside the value (e.g. `vllm_decode_x`)."""
    text: str
    """What it stands for, for the notes."""
    grid: tuple[float, ...]
    """Values tried, ascending."""
    shipped: float = 1.0
    """The value kvpool's figure is computed at."""


VLLM_DECODE = Assumption(
    "vllm_decode_x", "the colocated vLLM v0.5.1 baseline's decode-step terms (fixed, "
    "per-sequence, per-token; mixed steps too) as a multiple of the fitted Mooncake step: no "
    "paper figure gives vLLM v0.5.1's step on the papers' cluster",
    (0.4, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0))
MOONCAKE_PREFILL = Assumption(
    "mooncake_prefill_x", "Mooncake's prefill time (every prefill term) as a multiple of the "
    "papers' microbenchmark ([F] Fig.14), for what a live prefill instance pays beyond it "
    "(scheduling, misprediction); the papers measure none of it on [A]'s cluster",
    (0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0))


def scale_prefill(cost: CostModel, factor: float) -> CostModel:
    """`cost` with every prefill term (fixed, linear, quadratic) times `factor`."""
    return replace(cost, prefill_base_s=cost.prefill_base_s * factor,
                   prefill_linear_s=cost.prefill_linear_s * factor,
                   prefill_quadratic_s=cost.prefill_quadratic_s * factor)


def misses(ours: float | None, paper: float | None, band: tuple[float, float] | None = None,
           percent: bool = True) -> bool:
    """True when the report's verdict on `ours` beside `paper` is outside: neither within 25%
    (for a figure in `percent` under 10, 2.5 points) nor with `paper` inside `band`."""
    if ours is None or paper is None:
        return False
    return verdict(ours, paper, band, percent).startswith("outside")


def crossing(points: list[tuple[float, float | None]], target: float,
             shipped: float) -> float | None:
    """The assumption's value at which the figure equals `target`, by linear interpolation
    between neighbouring grid points that bracket it (nearest `shipped` first); None if none."""
    known = [(x, y) for x, y in points if y is not None]
    found: list[float] = []
    for (x0, y0), (x1, y1) in zip(known, known[1:], strict=False):
        if y0 == target:
            found.append(x0)
        elif (y0 - target) * (y1 - target) < 0:
            found.append(x0 + (x1 - x0) * (target - y0) / (y1 - y0))
    if known and known[-1][1] == target:
        found.append(known[-1][0])
    return min(found, key=lambda x: abs(x - shipped)) if found else None


def reach(assumption: Assumption, figures_at: Callable[[float], Mapping[str, float | None]],
          wanted: Mapping[str, float]) -> dict[str, dict[str, Any]]:
    """For each key of `wanted` (the paper's figure of each gain that misses): the value of
    `assumption` that reaches it (`value`, None if no grid value does) and the figure over the
    grid (`grid`: value -> figure). `figures_at(x)` runs the experiment's affected systems at
    the assumption's value x and returns every key's figure."""
    if not wanted:
        return {}
    per_x = {x: figures_at(x) for x in assumption.grid}
    out: dict[str, dict[str, Any]] = {}
    for key, paper in wanted.items():
        points = [(x, per_x[x].get(key)) for x in assumption.grid]
        out[key] = {"assumption": assumption.name, "paper": paper,
                    "value": crossing(points, paper, assumption.shipped),
                    "grid": {f"{x:g}": y for x, y in points}}
    return out


def describe(r: Mapping[str, Any] | None) -> str:
    """'vllm_decode_x 1.41' where the sweep reaches the paper's figure; 'not by
    vllm_decode_x 0.4..3 (+12..+150)' where it does not; '-' without a sweep."""
    if not r:
        return "-"
    if r.get("value") is not None:
        return f"{r['assumption']} {r['value']:.3g}"
    xs = list(r["grid"])
    ys = [y for y in r["grid"].values() if y is not None]
    span = f" ({min(ys):+.0f}..{max(ys):+.0f})" if ys else ""
    return f"not by {r['assumption']} {xs[0]}..{xs[-1]}{span}"
