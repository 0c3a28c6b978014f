"""Calibration of the decode terms on Mooncake's own curve (`kvpool sim calibrate`).

The papers price a decode step only by a one-request microbenchmark ([F] Fig.14, 26.5-30.8 ms),
but Mooncake's end-to-end runs show slower, more spread-out steps (Fig.1: median TBT 74 ms,
p10 57, p90 93). Two terms close that gap, and both are fitted on Mooncake's measurement
alone, never on a baseline's:

- `decode_factor` f: every decode-step term of the base profile times f (the step of a real
  batch, with its sampling, scheduling and launch costs, against the microbenchmark's);
- `decode_join_s` J: extra seconds of a step per request that joins a disaggregated decode
  batch with KV from a prefill instance (taking the request in: block tables, KV placement).

The fit replays the trace through Mooncake as the capacity figure runs it
(`kvpool.sim.systems.run_mooncake`) on a grid of (f, J), refines around the best point, and
minimises the mean square of the share errors (percentage points, 7 thresholds) and of the
TBT percentile errors (percent of the paper's value, where the figure publishes them). The
baselines then run on the same f (colocated instances compute their KV in place, so J does not
apply to them) and their curves are predictions.
"""

from __future__ import annotations

import json
import multiprocessing
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

from kvpool.conductor.cost import CostModel
from kvpool.engine.emulated.profile import DecodeCalibration, EngineProfile
from kvpool.errors import InvalidArgument
from kvpool.sim.systems import TTFT_LIMIT_S, run_mooncake
from kvpool.sim.trace import TraceRequest

THRESHOLDS_MS = (50, 100, 150, 200, 300, 500, 1000)
CURVES_PATH = Path(__file__).resolve().parents[1] / "data" / "paper" / "mooncake_tbt_curves.json"
TRACE_FIGURES = {"conversation": "fig1_conversation", "tool": "fig6_toolagent",
                 "synthetic": "fig7_synthetic"}
"""A trace file whose name contains the key is the workload of that figure."""
COARSE_FACTORS = (1.0, 1.2, 1.4, 1.6, 1.8, 2.0, 2.2, 2.4)
COARSE_JOINS_S = (0.0, 0.01, 0.02, 0.03, 0.04, 0.05, 0.06)


@dataclass(frozen=True, slots=True)
class PaperCurve:
    figure: str
    workload: str
    share_at_ms: dict[str, float]
    """Percent of requests Mooncake served within TTFT 30 s and each TBT threshold, keyed by
    the threshold in ms ("50", "100", ...)."""
    tbt_ms: dict[str, float]
    """p10/p50/p90 of Mooncake's per-request TBT, when the figure publishes them."""


@dataclass(frozen=True, slots=True)
class FitPoint:
    decode_factor: float
    decode_join_s: float
    share_at_ms: dict[str, float]
    tbt_ms: dict[str, float]
    share_rms_pp: float
    loss: float


def load_curves(path: Path | None = None) -> dict[str, PaperCurve]:
    """The paper's Mooncake curves by figure key (default: the packaged copy)."""
    src = path or CURVES_PATH
    try:
        figures = json.loads(src.read_text())["figures"]
        return {key: PaperCurve(key, fig["workload"],
                                {k.removesuffix("ms"): float(v)
                                 for k, v in fig["mooncake"].items()},
                                dict(fig.get("mooncake_tbt_percentiles_ms", {})))
                for key, fig in figures.items()}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InvalidArgument(f"cannot read the paper's curves from {src}: {exc}") from None


def figure_for_trace(trace: Path | None) -> str | None:
    """The paper figure whose workload `trace` is (None = the conversation trace), or None."""
    if trace is None:
        return "fig1_conversation"
    stem = trace.name.lower()
    return next((fig for key, fig in TRACE_FIGURES.items() if key in stem), None)


def curve_for(trace: Path | None, figure: str | None = None,
              curves: dict[str, PaperCurve] | None = None) -> PaperCurve | None:
    """The curve named `figure`, else the one of `trace`'s workload, else None."""
    curves = curves if curves is not None else load_curves()
    key = figure or figure_for_trace(trace)
    if key is None:
        return None
    if key not in curves:
        raise InvalidArgument(f"unknown figure {key!r}; known: {', '.join(sorted(curves))}")
    return curves[key]


def scale_decode(cost: CostModel, factor: float, seq_factor: float | None = None) -> CostModel:
    """`cost` with its decode step's fixed and per-token terms times `factor` and its
    per-sequence term times `seq_factor` (None = `factor`), to 6 significant digits."""
    def scaled(value: float, by: float) -> float:
        return float(f"{value * by:.6g}")

    seq = factor if seq_factor is None else seq_factor
    return replace(cost, decode_base_s=scaled(cost.decode_base_s, factor),
                   decode_per_seq_s=scaled(cost.decode_per_seq_s, seq),
                   decode_per_token_s=scaled(cost.decode_per_token_s, factor))


def with_decode_terms(base: EngineProfile, factor: float, join_s: float,
                      seq_factor: float | None = None) -> EngineProfile:
    """`base` with its decode step scaled by `factor` (its per-sequence term by `seq_factor`
    when given) and a join cost of `join_s`."""
    if factor <= 0 or join_s < 0 or (seq_factor is not None and seq_factor <= 0):
        raise InvalidArgument(f"need decode_factor > 0, seq_factor > 0 and decode_join_s >= 0, "
                              f"got {factor}, {seq_factor}, {join_s}")
    cost = replace(scale_decode(base.cost, factor, seq_factor), decode_join_s=join_s)
    return replace(base, cost=cost, calibration=None)


def score(share: dict[str, float], tbt: dict[str, float],
          curve: PaperCurve) -> tuple[float, float]:
    """(share RMS in points, loss): the loss averages the squared share errors (points) and
    the squared TBT percentile errors (percent of the paper's value)."""
    share_err = [share[k] - v for k, v in curve.share_at_ms.items() if k in share]
    pct_err = [100.0 * (tbt[k] - v) / v for k, v in curve.tbt_ms.items() if k in tbt]
    terms = [e * e for e in share_err + pct_err]
    rms = (sum(e * e for e in share_err) / len(share_err)) ** 0.5 if share_err else 0.0
    return rms, sum(terms) / len(terms) if terms else 0.0


def evaluate(reqs: Sequence[TraceRequest], base: EngineProfile, curve: PaperCurve,
             factor: float, join_s: float) -> FitPoint:
    return evaluate_profile(reqs, with_decode_terms(base, factor, join_s), curve, factor)


def evaluate_profile(reqs: Sequence[TraceRequest], profile: EngineProfile, curve: PaperCurve,
                     factor: float) -> FitPoint:
    """Mooncake's curve on `profile` (which carries the terms tried, `factor` among them)
    against the paper's `curve`."""
    res = run_mooncake(reqs, profile)
    share = res.share_at_ms([int(k) for k in curve.share_at_ms], TTFT_LIMIT_S)
    tbt = res.tbt_percentiles_ms()
    rms, loss = score(share, tbt, curve)
    return FitPoint(factor, profile.cost.decode_join_s, share, tbt, rms, loss)


_REQS: Sequence[TraceRequest] = ()


def _evaluate_in_child(args: tuple[EngineProfile, PaperCurve, float, float]) -> FitPoint:
    return evaluate(_REQS, *args)


def fit(reqs: Sequence[TraceRequest], base: EngineProfile, curve: PaperCurve,
        factors: Sequence[float] = COARSE_FACTORS, joins_s: Sequence[float] = COARSE_JOINS_S,
        refine: bool = True, jobs: int = 1,
        on_point: Callable[[FitPoint], None] | None = None) -> list[FitPoint]:
    """Every grid point tried, best (lowest loss) first: the coarse grid, then (with
    `refine`) the half-steps around the best coarse point."""
    points = _run_grid(reqs, base, curve, [(f, j) for f in factors for j in joins_s], jobs,
                       on_point)
    if refine and len(factors) > 1 and len(joins_s) > 1:
        best = min(points, key=lambda p: p.loss)
        df = (factors[1] - factors[0]) / 2
        dj = (joins_s[1] - joins_s[0]) / 2
        seen = {(round(p.decode_factor, 6), round(p.decode_join_s, 6)) for p in points}
        near = [(round(best.decode_factor + i * df, 6), round(max(0.0, best.decode_join_s
                                                                   + k * dj), 6))
                for i in (-1, 0, 1) for k in (-1, 0, 1)]
        fresh = sorted({pt for pt in near if pt not in seen and pt[0] > 0})
        points += _run_grid(reqs, base, curve, fresh, jobs, on_point)
    return sorted(points, key=lambda p: p.loss)


def _run_grid(reqs: Sequence[TraceRequest], base: EngineProfile, curve: PaperCurve,
              grid: list[tuple[float, float]], jobs: int,
              on_point: Callable[[FitPoint], None] | None) -> list[FitPoint]:
    out: list[FitPoint] = []
    if jobs <= 1:
        for f, j in grid:
            out.append(evaluate(reqs, base, curve, f, j))
            if on_point:
                on_point(out[-1])
        return out
    global _REQS
    _REQS = reqs
    ctx = multiprocessing.get_context("fork")
    with ProcessPoolExecutor(jobs, mp_context=ctx) as pool:
        for point in pool.map(_evaluate_in_child, [(base, curve, f, j) for f, j in grid]):
            out.append(point)
            if on_point:
                on_point(point)
    return out


def calibrated_profile(base: EngineProfile, best: FitPoint, curve: PaperCurve, trace: str,
                       name: str | None = None) -> EngineProfile:
    """`base` with the fitted terms and the record of the fit."""
    record = DecodeCalibration(
        figure=curve.figure, trace=trace, base_profile=base.name,
        decode_factor=best.decode_factor, decode_join_s=best.decode_join_s,
        share_rms_pp=round(best.share_rms_pp, 3),
        share_at_ms={k: round(v, 2) for k, v in best.share_at_ms.items()},
        paper_share_at_ms=dict(curve.share_at_ms),
        tbt_ms={k: round(v, 2) for k, v in best.tbt_ms.items()},
        paper_tbt_ms=dict(curve.tbt_ms))
    workload = curve.figure.split("_", 1)[-1]
    return replace(with_decode_terms(base, best.decode_factor, best.decode_join_s),
                   name=name or f"{base.name}-{workload}",
                   description=(f"{base.name} with its decode terms fitted to Mooncake's own TBT "
                                f"curve ({curve.workload}, [F] {curve.figure}) by `kvpool sim "
                                f"calibrate` on {trace}; see docs/sim.md."),
                   calibration=record)
