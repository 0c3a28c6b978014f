"""Experiment `overload`: rejected requests under overload by admission policy ([A] Table 3).

8P8D, trace replayed at 2x. Two decode calibrations are run:
- `calibrated`: the [F]-calibrated decode cost. The decode pool stays far below its TBT limit,
  so no request is refused at decode and the three policies differ only by noise;
- `a_like_decode`: decode step time scaled by DECODE_SCALE so that the decode pool runs near
  its limit as in [A] Fig.9 (decode load up to ~93%); this is the regime of [A] section 7.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from kvpool.conductor import CostModel
from kvpool.sim.experiments.common import (
    ExperimentOptions,
    ExperimentResult,
    pct_change,
    rnd,
    run_disagg,
    runs,
)
from kvpool.sim.metrics import SimResult

ADMISSIONS = ("none", "early_rejection", "early_rejection_predicted")
PAPER_REJECTED = {"none": 4183, "early_rejection": 3771, "early_rejection_predicted": 3589}
DECODE_SCALE = 2.2
DECODE_HORIZON_S = {"calibrated": 12.0, "a_like_decode": 30.0}
"""t_d: the mean output (343 tokens) times a step time near the TBT limit of each model."""


def scaled_decode(cost: CostModel, factor: float) -> CostModel:
    return replace(cost, decode_base_s=cost.decode_base_s * factor,
                   decode_per_seq_s=cost.decode_per_seq_s * factor,
                   decode_per_token_s=cost.decode_per_token_s * factor)


def run(opts: ExperimentOptions) -> ExperimentResult:
    reqs = opts.requests(default_speed=2.0)
    models: dict[str, CostModel] = {"calibrated": opts.cost, "a_like_decode": scaled_decode(opts.cost, DECODE_SCALE)}
    grid = [(m, a) for m in models for a in ADMISSIONS]
    rows: list[dict[str, Any]] = []
    loads: dict[tuple[str, str], SimResult] = {}
    for model, admission in runs(grid, opts.progress, "overload"):
        res = run_disagg(reqs, models[model], admission=admission, ttft_slo_s=30.0,
                         tbt_slo_s=0.1, decode_horizon_s=DECODE_HORIZON_S[model])
        loads[(model, admission)] = res
        rows.append(_row(model, admission, res))
    for row in rows:
        base = next(r for r in rows if r["decode_model"] == row["decode_model"]
                    and r["admission"] == "none")
        row["change_pct"] = rnd(pct_change(row["rejected"], base["rejected"]), 1)
        row["paper_change_pct"] = rnd(pct_change(PAPER_REJECTED[row["admission"]],
                                                 PAPER_REJECTED["none"]), 1)
    return ExperimentResult(
        "overload", "Rejected requests by admission policy, 8P8D, 2x replay ([A] Table 3)",
        ["decode_model", "admission", "rejected", "paper_rejected", "change_pct",
         "paper_change_pct", "rejected_arrival", "rejected_decode", "wasted_prefill_s",
         "missed_slo", "mean_ttft_s"],
        rows,
        notes=[f"a_like_decode scales decode step time by {DECODE_SCALE}x (see docs/sim.md).",
               "missed_slo: accepted requests that finished outside TTFT 30 s / TBT 100 ms.",
               "paper counts are out of 23,000 requests of another trace; compare the changes."],
        plot=lambda out: _plot(loads, out))


def _row(model: str, admission: str, res: SimResult) -> dict[str, Any]:
    s = res.summary()
    wasted = sum(r.prefill_gpu_s for r in res.records if r.rejected_stage == "decode")
    missed = sum(1 for r in res.records if r.completed and not r.meets(30.0, 0.1))
    return {"decode_model": model, "admission": admission, "rejected": s["rejected"],
            "paper_rejected": PAPER_REJECTED[admission],
            "rejected_arrival": s["rejected_arrival"], "rejected_decode": s["rejected_decode"],
            "wasted_prefill_s": rnd(wasted, 1), "missed_slo": missed,
            "mean_ttft_s": rnd(s["mean_ttft_s"])}


def _plot(loads: dict[tuple[str, str], SimResult], out: Path) -> Path:
    from kvpool.sim.report import new_figure, save

    fig, ax = new_figure()
    for admission in ADMISSIONS:
        res = loads[("a_like_decode", admission)]
        ts = [x.t_s / 60 for x in res.load]
        ax.plot(ts, [x.prefill_load for x in res.load], label=f"prefill load, {admission}")
        ax.plot(ts, [x.decode_load for x in res.load], "--", label=f"decode load, {admission}")
    ax.set_xlabel("time (min, replayed)")
    ax.set_ylabel("load (predicted / limit)")
    ax.set_title("overload, a_like_decode")
    ax.legend(fontsize=7)
    return save(fig, out / "overload.png")
