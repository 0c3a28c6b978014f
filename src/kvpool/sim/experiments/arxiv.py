"""Experiments `long-context` ([A] §8.1.2, Fig.12) and `public-datasets` ([A] §8.1.1, Fig.11):
the highest Poisson rate within the SLOs (`maxrps.py`) of vLLM-[4M] against Mooncake-[3P+1D]
and Mooncake-[2P+2D], on synthetic workloads (`kvpool.sim.synth`) built from [A] Table 2.

Systems, all on the experiment profile:
- vllm_4m: 4 colocated instances, round-robin dispatch, no prefix caching; in `long-context`
  one request at a time per instance (`VllmConfig.max_num_seqs=1`, as [A] ran it), in
  `public-datasets` vLLM's continuous batching;
- mooncake_3p1d / mooncake_2p2d: the disaggregated simulator, kvcache_centric scheduling, no
  admission control at arrival and no latency limit, 3M tokens of DRAM cache per prefill
  node; the decode stage still refuses a request whose KV does not fit in its VRAM beside
  the running batch (the `none` policy's own decode check), and a refused request counts as
  missing both limits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvpool.conductor import CostModel
from kvpool.sim.colocated import ColocatedSim
from kvpool.sim.disagg import DisaggConfig
from kvpool.sim.experiments.common import (
    NO_SLO_S,
    ExperimentOptions,
    ExperimentResult,
    pct_change,
    rnd,
    runs,
)
from kvpool.sim.experiments.maxrps import (
    SearchSpec,
    SloLimits,
    System,
    find_max_rps,
    lone_limits,
    measure,
)
from kvpool.sim.experiments.reach import MOONCAKE_PREFILL, misses, reach, scale_prefill
from kvpool.sim.experiments.reach import describe as describe_reach
from kvpool.sim.experiments.verdicts import in_percent
from kvpool.sim.metrics import SimResult
from kvpool.sim.synth import ARXIV, LEVAL, WorkloadSpec, generate, simulated
from kvpool.sim.systems import colocated_config
from kvpool.sim.trace import TraceRequest

SYSTEMS = ("vllm_4m", "mooncake_3p1d", "mooncake_2p2d")
SPLITS = {"mooncake_3p1d": (3, 1), "mooncake_2p2d": (2, 2)}
LENGTHS = (16_384, 32_768, 65_536, 131_072)
REQUESTS_PER_POINT = {"long-context": 600, "public-datasets": 1000}
"""Requests of every probed rate (`--limit` replaces it)."""
SEED = 0
PAPER_LONG = {16_384: (0.2, 1.25), 32_768: (0.2, 0.6), 65_536: (0.2, 0.3), 131_072: (0.12, 0.14)}
"""[A] Fig.12 (eye): (vLLM-[4M], Mooncake-[3P+1D]) max RPS; 128k's 0.14 is a lower bound."""
PAPER_DATASET_GAIN = {"arxiv": 20.0, "l-eval": 40.0}
"""[A] §8.1.1: Mooncake-[3P+1D]'s throughput gain over vLLM-[4M] within the SLOs."""


def system(opts: ExperimentOptions, name: str, one_at_a_time: bool = False,
           cost: CostModel | None = None) -> System:
    """One of SYSTEMS on the experiment profile (module docstring); `cost` replaces the
    profile's for a Mooncake split (the reach sweep)."""
    if name == "vllm_4m":
        base = colocated_config("vllm", opts.profile)
        vllm = replace(base.vllm, max_num_seqs=1) if one_at_a_time else base.vllm
        config = replace(base, num_instances=4, vllm=vllm)
        return lambda reqs: ColocatedSim(opts.cost, config).run(reqs)
    num_p, num_d = SPLITS[name]
    disagg = DisaggConfig(num_prefill=num_p, num_decode=num_d)

    def run(reqs: Sequence[TraceRequest]) -> SimResult:
        return opts.run_disagg(reqs, config=disagg, cost=cost, admission="none",
                               ttft_slo_s=NO_SLO_S, tbt_slo_s=NO_SLO_S)
    return run


def spec_limits(opts: ExperimentOptions, spec: WorkloadSpec, stat: str = "mean") -> SloLimits:
    return lone_limits(opts.cost, spec.input_len.mean, spec.output_len.mean, stat)


def search_row(opts: ExperimentOptions, spec: WorkloadSpec, name: str, one_at_a_time: bool,
               num_requests: int) -> dict[str, Any]:
    """The max-RPS search of system `name` on `spec`, as a result row: by [A]'s mean time
    between tokens, and (`max_rps_top10`) by [F]'s mean of the longest 10% of gaps."""
    reqs = generate(spec, num_requests, SEED)
    limits, run = spec_limits(opts, spec), system(opts, name, one_at_a_time)
    best, seen = find_max_rps(lambda rps: measure(run, reqs, rps, limits, SEED),
                              SearchSpec(seed=SEED))
    top10 = spec_limits(opts, spec, "top10")
    alt, _ = find_max_rps(lambda rps: measure(run, reqs, rps, top10, SEED),
                          SearchSpec(seed=SEED))
    return {"workload": spec.name, "system": name,
            "max_rps": rnd(best.rps if best else 0.0),
            "p90_ttft_norm": rnd(best.p90_ttft_s / limits.ttft_s) if best else None,
            "p90_tbt_norm": rnd(best.p90_tbt_s / limits.tbt_s) if best else None,
            "ttft_limit_s": rnd(limits.ttft_s, 2), "tbt_limit_ms": rnd(1000 * limits.tbt_s, 1),
            "probes": len(seen), "max_rps_top10": rnd(alt.rps if alt else 0.0),
            "tbt_top10_limit_ms": rnd(1000 * top10.tbt_s, 1)}


def max_rps(opts: ExperimentOptions, spec: WorkloadSpec, name: str, num_requests: int,
            cost: CostModel) -> float:
    """The max-RPS search of Mooncake split `name` on `cost`, within the limits the profile
    sets (the same for every system)."""
    reqs = generate(spec, num_requests, SEED)
    limits, run = spec_limits(opts, spec), system(opts, name, cost=cost)
    best, _ = find_max_rps(lambda rps: measure(run, reqs, rps, limits, SEED),
                           SearchSpec(seed=SEED))
    return best.rps if best else 0.0


def _reach_mooncake(opts: ExperimentOptions, rows: list[dict[str, Any]], n: int,
                    specs: dict[str, WorkloadSpec]) -> None:
    """Each Mooncake-[3P+1D] gain and max RPS that misses the paper's: the factor on
    Mooncake's prefill at which it is the paper's (experiments/reach.py; one search per
    workload and factor gives both). `specs`: the workloads by name."""
    moon = {r["workload"]: r for r in rows if r["system"] == "mooncake_3p1d"}
    vllm = {r["workload"]: r["max_rps"] for r in rows if r["system"] == "vllm_4m"}
    wanted: dict[str, float] = {}
    for name, r in moon.items():
        for field in ("gain_pct", "max_rps"):
            if misses(r.get(field), r.get(f"paper_{field}"), percent=in_percent(field)):
                wanted[f"{field}@{name}"] = float(r[f"paper_{field}"])
    names = list(dict.fromkeys(k.split("@")[1] for k in wanted))

    def figures_at(factor: float) -> dict[str, float | None]:
        out: dict[str, float | None] = {}
        for name in names:
            rps = float(moon[name]["max_rps"]) if factor == MOONCAKE_PREFILL.shipped else \
                round(max_rps(opts, specs[name], "mooncake_3p1d", n,
                              scale_prefill(opts.cost, factor)), 3)
            out[f"max_rps@{name}"] = rps
            out[f"gain_pct@{name}"] = rnd(pct_change(rps, vllm[name]), 1)
        return out
    for key, found in reach(MOONCAKE_PREFILL, figures_at, wanted).items():
        field, name = key.split("@")
        moon[name][f"reach_{field}"] = found
        if field == "gain_pct":
            moon[name]["reached_at"] = describe_reach(found)


def _add_gains(rows: list[dict[str, Any]]) -> None:
    """gain_pct (and gain_top10_pct) of each Mooncake row over vLLM on the same workload;
    `best` marks the higher Mooncake split."""
    for wl in dict.fromkeys(r["workload"] for r in rows):
        group = [r for r in rows if r["workload"] == wl]
        base = next(r for r in group if r["system"] == "vllm_4m")
        moon = [r for r in group if r["system"] != "vllm_4m"]
        for r in moon:
            r["gain_pct"] = rnd(pct_change(r["max_rps"], base["max_rps"]), 1)
            r["gain_top10_pct"] = rnd(pct_change(r["max_rps_top10"], base["max_rps_top10"]), 1)
        max(moon, key=lambda r: r["max_rps"])["best"] = "yes"


def _requests(opts: ExperimentOptions, name: str) -> int:
    return opts.limit if opts.limit is not None else REQUESTS_PER_POINT[name]


LONG_COLUMNS = ["input_len", "system", "max_rps", "paper_max_rps", "gain_pct", "paper_gain_pct",
                "reached_at", "best", "p90_ttft_norm", "p90_tbt_norm", "ttft_limit_s", "tbt_limit_ms",
                "max_rps_top10", "gain_top10_pct"]


def run_long_context(opts: ExperimentOptions) -> ExperimentResult:
    n = _requests(opts, "long-context")
    grid = [(length, name) for length in LENGTHS for name in SYSTEMS]
    rows = [search_row(opts, simulated(length), name, True, n)
            for length, name in runs(grid, opts.progress, "long-context")]
    _add_gains(rows)
    for row, (length, name) in zip(rows, grid, strict=True):
        vllm, moon = PAPER_LONG[length]
        row["input_len"] = length
        row["paper_max_rps"] = {"vllm_4m": vllm, "mooncake_3p1d": moon}.get(name)
        row["paper_gain_pct"] = rnd(pct_change(moon, vllm), 0) if name == "mooncake_3p1d" else None
    if opts.reach:
        _reach_mooncake(opts, rows, n, {simulated(k).name: simulated(k) for k in LENGTHS})
    return ExperimentResult(
        "long-context", "Max RPS within P90 TTFT / TBT limits, simulated long-context data, "
        f"output 512, 50% cache ratio ([A] Fig.12), {n} requests per rate",
        LONG_COLUMNS, rows, notes=_notes(n) + [
            "vllm_4m runs one request at a time per instance ([A] §8.1.2); paper: Mooncake "
            "50%-525% higher; paper_max_rps read off Fig.12 by eye (128k: a lower bound).",
            "the 50% reuse: each request's first half is one of 8 shared documents (the paper "
            "does not say how its data reuse arises); vLLM has no prefix cache.",
            _reach_note()],
        plot=lambda out: _plot(rows, "input_len", out / "long-context.png"))


def run_public_datasets(opts: ExperimentOptions) -> ExperimentResult:
    n = _requests(opts, "public-datasets")
    grid = [(spec, name) for spec in (ARXIV, LEVAL) for name in SYSTEMS]
    rows = [search_row(opts, spec, name, False, n)
            for spec, name in runs(grid, opts.progress, "public-datasets")]
    _add_gains(rows)
    for row in rows:
        gain = PAPER_DATASET_GAIN[row["workload"]]
        row["paper_gain_pct"] = gain if row["system"] == "mooncake_3p1d" else None
    if opts.reach:
        _reach_mooncake(opts, rows, n, {spec.name: spec for spec in (ARXIV, LEVAL)})
    return ExperimentResult(
        "public-datasets", "Max RPS within P90 TTFT / TBT limits, ArXiv Summarization and "
        f"L-Eval ([A] Fig.11), {n} requests per rate",
        ["workload", *LONG_COLUMNS[1:3], *LONG_COLUMNS[4:]], rows, notes=_notes(n) + [
            "vllm_4m: continuous batching (vLLM's default scheduler), no prefix caching; "
            "paper: Mooncake-[3P+1D] +20% (ArXiv) and +40% (L-Eval) over vLLM-[4M].",
            "workloads: synthetic, from Table 2's means and cache ratios only (distributions "
            "in kvpool.sim.synth: lognormal lengths, cv 0.5; L-Eval: 8 questions per document "
            "in a row, warm cache ratio 0.85).", _reach_note()],
        plot=lambda out: _plot(rows, "workload", out / "public-datasets.png"))


def _reach_note() -> str:
    return (f"reached_at: for a gain (or max RPS) outside 25%, the value of "
            f"{MOONCAKE_PREFILL.name} ({MOONCAKE_PREFILL.text}) at which it is the paper's, "
            f"swept over {', '.join(f'{x:g}' for x in MOONCAKE_PREFILL.grid)} "
            "(experiments/reach.py).")


def _notes(n: int) -> list[str]:
    return [
        "limits per workload, the same for every system: TTFT 10x a lone cold prefill of the "
        "mean input; TBT 5x a lone request's TBT on a Mooncake decode instance (step at batch 1 "
        "+ its join cost); *_norm = P90 / limit at max_rps.",
        "TBT of a request: [A]'s mean time between tokens (max_rps, gain_pct; [A] gives its "
        "limit in s/token); *_top10: the same search with [F]'s mean of the longest 10% of "
        "gaps, which a single prefill stall dominates.",
        f"search: Poisson arrivals (seed {SEED}), the same {n} requests at every rate, rate "
        "doubled from 0.05 req/s until it fails, then 5 log-space bisections; an unfinished "
        "request counts as a miss (Mooncake's decode refuses KV that does not fit its VRAM). "
        "gain_pct: over vllm_4m; best: the better Mooncake split."]


def _plot(rows: list[dict[str, Any]], key: str, path: Path) -> Path:
    from kvpool.sim.report import new_figure, save

    fig, ax = new_figure()
    groups = list(dict.fromkeys(r[key] for r in rows))
    width = 0.8 / len(SYSTEMS)
    for i, name in enumerate(SYSTEMS):
        ys = [next(r["max_rps"] for r in rows if r[key] == g and r["system"] == name)
              for g in groups]
        ax.bar([x + (i - 1) * width for x in range(len(groups))], ys, width, label=name)
    paper = [(x + (SYSTEMS.index(r["system"]) - 1) * width, r["paper_max_rps"])
             for x, g in enumerate(groups) for r in rows
             if r[key] == g and r.get("paper_max_rps") is not None]
    if paper:
        ax.plot(*zip(*paper, strict=True), "k*", linestyle="none", label="paper (eye)")
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([str(g) for g in groups])
    ax.set_xlabel(key)
    ax.set_ylabel("max RPS within P90 TTFT and TBT limits")
    ax.legend()
    return save(fig, path)
