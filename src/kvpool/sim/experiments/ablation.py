"""Experiment `capacity-ablation`: what each modelled vLLM v0.5.1 behaviour does to the baseline
of the `capacity` experiment. Every `VllmConfig` switch is turned off alone, then all of them."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from kvpool.sim.colocated import ColocatedConfig, ColocatedSim, VllmConfig
from kvpool.sim.experiments.capacity import PAPER_EFFECTIVE, SYSTEMS, THRESHOLDS_MS, TTFT_LIMIT_S
from kvpool.sim.experiments.common import ExperimentOptions, ExperimentResult, rnd, runs

ON = VllmConfig()
SWITCHES: dict[str, tuple[str, ...]] = {
    "vllm": ("batch_prefills", "preempt_recompute"),
    "vllm_prefix": ("batch_prefills", "shared_vram_cache", "preempt_recompute"),
    "vllm_chunked": ("batch_prefills", "chunk_overhead_s", "preempt_recompute"),
}


def _without(switch: str) -> VllmConfig:
    if switch == "chunk_overhead_s":
        return replace(ON, chunk_overhead_s=0.0)
    if switch == "batch_prefills":
        return replace(ON, batch_prefills=False)
    if switch == "preempt_recompute":
        return replace(ON, preempt_recompute=False)
    return replace(ON, shared_vram_cache=False)


def grid() -> list[tuple[str, str, VllmConfig]]:
    out: list[tuple[str, str, VllmConfig]] = []
    for system, switches in SWITCHES.items():
        out.append((system, "all on", ON))
        out.extend((system, f"without {s}", _without(s)) for s in switches)
        out.append((system, "all off", VllmConfig.off()))
    return out


def run(opts: ExperimentOptions) -> ExperimentResult:
    reqs = opts.requests()
    rows: list[dict[str, Any]] = []
    for system, setting, vllm in runs(grid(), opts.progress, "capacity-ablation"):
        base = SYSTEMS[system]
        assert isinstance(base, ColocatedConfig)
        sim = ColocatedSim(opts.cost, replace(base, vllm=vllm))
        res = sim.run(reqs)
        row: dict[str, Any] = {"system": system, "setting": setting}
        for th in THRESHOLDS_MS:
            row[f"effective_{th}ms"] = rnd(res.attainment(TTFT_LIMIT_S, th / 1000))
        row["mean_ttft_s"] = rnd(res.summary()["mean_ttft_s"])
        row["prefill_gpu_s"] = rnd(res.prefill_gpu_s())
        row["preemptions"] = sim.num_preempted()
        rows.append(row)
    paper: dict[str, Any] = {"system": "paper", "setting": "best vLLM (eye)"}
    paper.update({f"effective_{t}ms": PAPER_EFFECTIVE["best_vllm"][t] for t in THRESHOLDS_MS})
    rows.append(paper | {"mean_ttft_s": None, "prefill_gpu_s": None, "preemptions": None})
    return ExperimentResult(
        "capacity-ablation", "vLLM v0.5.1 behaviours of the colocated baseline, one at a time",
        ["system", "setting", *[f"effective_{t}ms" for t in THRESHOLDS_MS], "mean_ttft_s",
         "prefill_gpu_s", "preemptions"],
        rows, notes=["'all off' is VllmConfig.off(): one prompt per step, no chunk overhead, "
                     "a prefix cache beside (not inside) the running requests' VRAM, input + "
                     "output reserved at start and no preemption."],
        plot=lambda out: _plot(rows, out))


def _plot(rows: list[dict[str, Any]], out: Path) -> Path:
    from kvpool.sim.report import new_figure, save

    fig, ax = new_figure()
    for row in rows:
        style = "k--" if row["system"] == "paper" else "-"
        ax.plot(THRESHOLDS_MS, [row[f"effective_{t}ms"] for t in THRESHOLDS_MS], style,
                marker="o", label=f"{row['system']}: {row['setting']}")
    ax.set_xlabel("TBT threshold (ms)")
    ax.set_ylabel("share of requests within SLOs")
    ax.legend(fontsize=6)
    return save(fig, out / "capacity-ablation.png")
