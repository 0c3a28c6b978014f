"""Experiment `capacity-ablation`: what each modelled vLLM v0.5.1 behaviour does to the baseline
of the `capacity` experiment. Every `VllmConfig` switch is turned off alone, then all of them;
then, with all on, the baseline's decode step is made slower than Mooncake's by the factors in
`DECODE_SLOWER` (an assumption the paper does not publish: vLLM v0.5.1 runs a batch holding a
context over 8,192 tokens without CUDA graphs), to measure what that assumption is worth."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from kvpool.sim.calibrate import scale_decode
from kvpool.sim.colocated import ColocatedSim, VllmConfig
from kvpool.sim.experiments.capacity import GAIN_THRESHOLDS_MS, PAPER_BEST_VLLM
from kvpool.sim.experiments.common import ExperimentOptions, ExperimentResult, rnd, runs
from kvpool.sim.systems import TTFT_LIMIT_S, colocated_config

ON = VllmConfig()
DECODE_SLOWER = (1.25, 1.5)
"""Factors on the baseline's decode step, beside Mooncake's (the profile's)."""
SWITCHES: dict[str, tuple[str, ...]] = {
    "vllm": ("batch_prefills", "preempt_recompute", "max_seq_len_to_capture"),
    "vllm_prefix": ("batch_prefills", "shared_vram_cache", "preempt_recompute",
                    "max_seq_len_to_capture"),
    "vllm_chunked": ("batch_prefills", "chunk_overhead_s", "preempt_recompute",
                     "max_seq_len_to_capture"),
}


def _without(on: VllmConfig, switch: str) -> VllmConfig:
    if switch == "chunk_overhead_s":
        return replace(on, chunk_overhead_s=0.0)
    if switch == "batch_prefills":
        return replace(on, batch_prefills=False)
    if switch == "preempt_recompute":
        return replace(on, preempt_recompute=False)
    if switch == "max_seq_len_to_capture":
        return replace(on, max_seq_len_to_capture=0)  # every decode step from a graph
    return replace(on, shared_vram_cache=False)


def grid(on: VllmConfig = ON) -> list[tuple[str, str, VllmConfig, float]]:
    """(system, setting, behaviours, factor on the decode step) of every run."""
    out: list[tuple[str, str, VllmConfig, float]] = []
    for system, switches in SWITCHES.items():
        out.append((system, "all on", on, 1.0))
        out.extend((system, f"without {s}", _without(on, s), 1.0) for s in switches)
        out.append((system, "all off", VllmConfig.off(), 1.0))
        out.extend((system, f"decode x{f}", on, f) for f in DECODE_SLOWER)
    return out


def run(opts: ExperimentOptions) -> ExperimentResult:
    reqs = opts.requests()
    rows: list[dict[str, Any]] = []
    on = VllmConfig(chunk_overhead_s=opts.profile.chunk_overhead_s)
    for system, setting, vllm, factor in runs(grid(on), opts.progress, "capacity-ablation"):
        base = colocated_config(system, opts.profile)
        sim = ColocatedSim(scale_decode(opts.cost, factor), replace(base, vllm=vllm))
        res = sim.run(reqs)
        row: dict[str, Any] = {"system": system, "setting": setting}
        for th in GAIN_THRESHOLDS_MS:
            row[f"effective_{th}ms"] = rnd(100 * res.attainment(TTFT_LIMIT_S, th / 1000), 2)
        row["mean_ttft_s"] = rnd(res.summary()["mean_ttft_s"])
        row["prefill_gpu_s"] = rnd(res.prefill_gpu_s())
        row["preemptions"] = sim.num_preempted()
        rows.append(row)
    paper: dict[str, Any] = {"system": "paper", "setting": "best vLLM (eye)"}
    best = PAPER_BEST_VLLM["fig1_conversation"]
    paper.update({f"effective_{t}ms": best[str(t)] for t in GAIN_THRESHOLDS_MS})
    rows.append(paper | {"mean_ttft_s": None, "prefill_gpu_s": None, "preemptions": None})
    return ExperimentResult(
        "capacity-ablation", "vLLM v0.5.1 behaviours of the colocated baseline, one at a time",
        ["system", "setting", *[f"effective_{t}ms" for t in GAIN_THRESHOLDS_MS], "mean_ttft_s",
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
        ax.plot(GAIN_THRESHOLDS_MS, [row[f"effective_{t}ms"] for t in GAIN_THRESHOLDS_MS], style,
                marker="o", label=f"{row['system']}: {row['setting']}")
    ax.set_xlabel("TBT threshold (ms)")
    ax.set_ylabel("% of requests within SLOs")
    ax.legend(fontsize=6)
    return save(fig, out / "capacity-ablation.png")
