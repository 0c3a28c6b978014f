"""Experiment `overload`: rejected requests under overload by admission policy ([A] Table 3),
and the accepted requests that still missed the SLOs, across operating points.

8P8D on the experiment profile (decode terms fitted on Mooncake's own curve, docs/sim.md).
Operating points:
- `sweep`: the trace replayed at 1x to 3x with [F]'s limits (TTFT 30 s, TBT 100 ms); 2x is
  [A]'s replay speed, the calibrated operating point;
- `matched`: the replay speed that offers [A]'s decode token rate at 2x, with SLOs of 10x / 5x
  the mean request's latency served alone ([A] section 2).
Admission predicts the statistics the SLOs are judged on: the first token's wait, and the mean
of the longest 10% of gaps including the join stalls the request will live through
(kvpool.conductor.decode.tbt_statistic_s). t_d (the prediction's decode horizon) is derived
per point.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpool.conductor import CostModel
from kvpool.sim.experiments import regime
from kvpool.sim.experiments.common import (
    ExperimentOptions,
    ExperimentResult,
    pct_change,
    rnd,
    runs,
)
from kvpool.sim.metrics import SimResult
from kvpool.sim.trace import TraceRequest, speed_up

ADMISSIONS = ("none", "early_rejection", "early_rejection_predicted")
PAPER_REJECTED = {"none": 4183, "early_rejection": 3771, "early_rejection_predicted": 3589}
NUM_PREFILL = NUM_DECODE = 8
PAPER_SPEED = 2.0
SWEEP_SPEEDS = (1.0, 1.5, 2.0, 2.5, 3.0)
TTFT_SLO_S = 30.0
TBT_SLO_S = 0.1


@dataclass(frozen=True, slots=True)
class Point:
    name: str
    speed: float
    ttft_slo_s: float
    tbt_slo_s: float
    decode_horizon_s: float


def points(reqs: list[TraceRequest], cost: CostModel, speed: float | None) -> list[Point]:
    """The sweep (or the one `speed` given) and the matched point."""
    load = regime.trace_load(reqs, cost)

    def horizon(s: float) -> float:
        return regime.decode_horizon_s(load, cost, NUM_DECODE, s)

    speeds = SWEEP_SPEEDS if speed is None else (speed,)
    out = [Point("sweep", s, TTFT_SLO_S, TBT_SLO_S, horizon(s)) for s in speeds]
    m_speed = regime.matched_speed(load)
    ttft, tbt = regime.matched_slos(load, cost)
    return [*out, Point("matched", m_speed, ttft, tbt, horizon(m_speed))]


def run(opts: ExperimentOptions) -> ExperimentResult:
    reqs = opts.requests()
    grid = [(p, a) for p in points(reqs, opts.cost, opts.speed) for a in ADMISSIONS]
    rows: list[dict[str, Any]] = []
    for pt, admission in runs(grid, opts.progress, "overload"):
        res = opts.run_disagg(speed_up(reqs, pt.speed), admission=admission,
                              ttft_slo_s=pt.ttft_slo_s, tbt_slo_s=pt.tbt_slo_s,
                              decode_horizon_s=pt.decode_horizon_s)
        rows.append(_row(pt, admission, res))
    for row in rows:
        base = next(r for r in rows if r["point"] == row["point"] and r["speed"] == row["speed"]
                    and r["admission"] == "none")
        row["change_pct"] = rnd(pct_change(row["rejected"], base["rejected"]), 1)
        paper = row["point"] == "sweep" and row["speed"] == PAPER_SPEED
        row["paper_rejected"] = PAPER_REJECTED[row["admission"]] if paper else None
        row["paper_change_pct"] = rnd(pct_change(PAPER_REJECTED[row["admission"]],
                                                 PAPER_REJECTED["none"]), 1) if paper else None
    return ExperimentResult(
        "overload", "Rejected and SLO-missing requests by admission policy, 8P8D ([A] Table 3)",
        ["point", "speed", "ttft_slo_s", "tbt_slo_ms", "t_d_s", "admission", "rejected",
         "paper_rejected", "change_pct", "paper_change_pct", "rejected_arrival",
         "rejected_decode", "wasted_prefill_s", "missed_slo", "within_slo",
         "peak_decode_load", "mean_ttft_s"],
        rows,
        notes=["missed_slo: accepted requests that finished outside the limits; within_slo: "
               "requests served within both (the goodput).",
               "wasted_prefill_s: prefill seconds spent on requests decode then refused.",
               "paper counts are out of 23,000 requests of another trace at 2x; compare changes."],
        plot=lambda out: _plot(rows, out))


def _row(pt: Point, admission: str, res: SimResult) -> dict[str, Any]:
    s = res.summary()
    wasted = sum(r.prefill_gpu_s for r in res.records if r.rejected_stage == "decode")
    within = sum(1 for r in res.records if r.meets(pt.ttft_slo_s, pt.tbt_slo_s))
    return {"point": pt.name, "speed": rnd(pt.speed), "ttft_slo_s": rnd(pt.ttft_slo_s, 2),
            "tbt_slo_ms": rnd(pt.tbt_slo_s * 1000, 1), "t_d_s": rnd(pt.decode_horizon_s, 1),
            "admission": admission, "rejected": s["rejected"],
            "rejected_arrival": s["rejected_arrival"], "rejected_decode": s["rejected_decode"],
            "wasted_prefill_s": rnd(wasted, 1), "missed_slo": s["num_completed"] - within,
            "within_slo": within,
            "peak_decode_load": rnd(max((x.decode_load for x in res.load), default=0.0), 2),
            "mean_ttft_s": rnd(s["mean_ttft_s"])}


def _plot(rows: list[dict[str, Any]], out: Path) -> Path:
    from kvpool.sim.report import new_figure, save

    fig, ax = new_figure()
    sweep = [r for r in rows if r["point"] == "sweep"]
    for admission in ADMISSIONS:
        pts = [r for r in sweep if r["admission"] == admission]
        xs = [r["speed"] for r in pts]
        ax.plot(xs, [r["rejected"] for r in pts], marker="o", label=f"rejected, {admission}")
        ax.plot(xs, [r["missed_slo"] for r in pts], "--", marker="x",
                label=f"accepted, missed SLO, {admission}")
    ax.set_xlabel("replay speed (x the trace's rate)")
    ax.set_ylabel("requests")
    ax.set_title("overload, 8P8D, TTFT 30 s / TBT 100 ms")
    ax.legend(fontsize=7)
    return save(fig, out / "overload.png")
