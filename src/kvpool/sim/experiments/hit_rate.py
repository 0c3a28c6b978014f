"""Experiment `hit-rate`: prefix hit rate of one global cache by capacity and eviction policy
([A] Table 1; PAPER.md section 5 has the conversation trace's measured LRU figures)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvpool.sim.cache import EVICTION_POLICIES, hit_rate
from kvpool.sim.experiments.common import ExperimentOptions, ExperimentResult, rnd, runs
from kvpool.sim.trace import load_trace

CAPACITIES: tuple[int | None, ...] = (1000, 10000, 30000, 50000, 100000, None)
# PAPER.md section 5: LRU on the released conversation trace
PAPER_CONVERSATION_LRU = {1000: 0.044, 10000: 0.211, 30000: 0.326, 50000: 0.355,
                          100000: 0.364, None: 0.366}
# [A] Table 1 (the 23,608-request trace of [A], not the conversation trace)
PAPER_A_TABLE1 = {
    "lru": {None: 0.51, 100000: 0.51, 50000: 0.50, 30000: 0.48, 10000: 0.40, 1000: 0.30},
    "lfu": {None: 0.51, 100000: 0.51, 50000: 0.49, 30000: 0.43, 10000: 0.35, 1000: 0.30},
    "length_aware": {None: 0.51, 100000: 0.50, 50000: 0.48, 30000: 0.42, 10000: 0.35,
                     1000: 0.30},
}


def run(opts: ExperimentOptions) -> ExperimentResult:
    blocks = [r.block_hashes for r in load_trace(opts.trace, opts.limit)]
    grid = [(p, c) for p in EVICTION_POLICIES for c in CAPACITIES]
    rows: list[dict[str, Any]] = []
    for policy, cap in runs(grid, opts.progress, "hit-rate"):
        paper = PAPER_CONVERSATION_LRU.get(cap) if policy == "lru" else None
        rows.append({"policy": policy, "capacity_blocks": cap,
                     "hit_rate": rnd(hit_rate(blocks, cap, policy), 4),
                     "paper_conversation": paper,
                     "paper_a_table1": PAPER_A_TABLE1[policy][cap]})
    return ExperimentResult(
        "hit-rate", "Prefix hit rate vs global cache capacity (blocks of 512 tokens)",
        ["policy", "capacity_blocks", "hit_rate", "paper_conversation", "paper_a_table1"],
        rows,
        notes=["paper_conversation: measured LRU figures of this trace (PAPER.md 5).",
               "paper_a_table1: [A] Table 1, measured on a different (23,608-request) trace."],
        plot=lambda out: _plot(rows, out))


def _plot(rows: list[dict[str, Any]], out: Path) -> Path:
    from kvpool.sim.report import new_figure, save

    fig, ax = new_figure()
    xs = [c if c is not None else 300000 for c in CAPACITIES]
    for policy in EVICTION_POLICIES:
        ys = [r["hit_rate"] for r in rows if r["policy"] == policy]
        ax.plot(xs, ys, marker="o", label=f"kvpool {policy}")
    ax.plot(xs, [PAPER_CONVERSATION_LRU[c] for c in CAPACITIES], "k--", label="paper LRU (trace)")
    ax.set_xscale("log")
    ax.set_xlabel("cache capacity (blocks; rightmost = unlimited)")
    ax.set_ylabel("prefix hit rate")
    ax.legend()
    return save(fig, out / "hit-rate.png")
