"""Experiment `scheduling`: mean TTFT by prefill scheduling policy on 16 nodes ([F] Fig.5).

[F] does not give the P/D split of this experiment; kvpool runs 8P8D (the split used
elsewhere) and 6P10D (a more loaded prefill pool). Every request is served (no TTFT limit), as
the paper reports the mean over all requests.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvpool.sim.disagg import DisaggConfig
from kvpool.sim.experiments.common import (
    NO_SLO_S,
    ExperimentOptions,
    ExperimentResult,
    rnd,
    runs,
)

POLICIES = ("kvcache_centric", "cache_aware", "load_balance", "random")
PAPER_NAMES = {"kvcache_centric": "global cache-aware", "cache_aware": "local cache-aware",
               "load_balance": "load balancing", "random": "random"}
PAPER_TTFT_S = {"kvcache_centric": 3.07, "cache_aware": 3.58, "load_balance": 5.27,
                "random": 19.65}
SPLITS = ((8, 8), (6, 10))


def run(opts: ExperimentOptions) -> ExperimentResult:
    reqs = opts.requests()
    grid = [(s, p) for s in SPLITS for p in POLICIES]
    rows: list[dict[str, Any]] = []
    for (num_p, num_d), policy in runs(grid, opts.progress, "scheduling"):
        res = opts.run_disagg(reqs, config=DisaggConfig(num_prefill=num_p, num_decode=num_d),
                         prefill_policy=policy, admission="none", ttft_slo_s=NO_SLO_S)
        s = res.summary()
        rows.append({"split": f"{num_p}P{num_d}D", "policy": policy,
                     "paper_name": PAPER_NAMES[policy], "mean_ttft_s": rnd(s["mean_ttft_s"]),
                     "paper_mean_ttft_s": PAPER_TTFT_S[policy],
                     "p90_ttft_s": rnd(s["p90_ttft_s"]), "hit_rate": rnd(s["hit_rate"])})
    for row in rows:
        base = next(r for r in rows if r["split"] == row["split"]
                    and r["policy"] == "kvcache_centric")
        row["ratio_to_best"] = rnd(row["mean_ttft_s"] / base["mean_ttft_s"], 2)
        row["paper_ratio"] = rnd(PAPER_TTFT_S[row["policy"]] / PAPER_TTFT_S["kvcache_centric"], 2)
    return ExperimentResult(
        "scheduling", "Mean TTFT by prefill scheduling policy, 16 nodes ([F] Fig.5)",
        ["split", "policy", "paper_name", "mean_ttft_s", "paper_mean_ttft_s", "ratio_to_best",
         "paper_ratio", "p90_ttft_s", "hit_rate"],
        rows, notes=["ratio_to_best: mean TTFT over kvcache_centric's in the same split."],
        plot=lambda out: _plot(rows, out))


def _plot(rows: list[dict[str, Any]], out: Path) -> Path:
    from kvpool.sim.report import bar_pairs, new_figure, save

    fig, ax = new_figure()
    first = [r for r in rows if r["split"] == rows[0]["split"]]
    bar_pairs(ax, [PAPER_NAMES[r["policy"]] for r in first], [r["mean_ttft_s"] for r in first],
              [r["paper_mean_ttft_s"] for r in first], "mean TTFT (s)")
    ax.set_title(f"scheduling policies, {first[0]['split']}")
    return save(fig, out / "scheduling.png")
