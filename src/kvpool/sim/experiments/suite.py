"""`kvpool sim experiment all`: every experiment, and one markdown report that sets each of
kvpool's figures beside the paper's, with a verdict per figure.

The report (`report.md` in the output directory, beside every experiment's PNG) has one
section per run: the experiment's own table, its plot, and a verdict table built from the
JSON rows. A row field `X` with a field `paper_X` beside it (a number, or a dict of numbers
such as `share_at_ms`) is a figure the paper gives; its verdict is

- `within 25%`: |kvpool - paper| <= 25% of the paper's value (or 2.5 points, for a share in
  percent under 10);
- `inside the band`: otherwise, when the paper's value lies inside the range kvpool gives over
  its calibration's neighbourhood (the `*_band_*` fields of experiments/band.py);
- `outside (higher|lower)`: neither; where the experiment swept the named assumption that
  moves the figure (a `reach_X` field, experiments/reach.py), the verdict says at which value
  of it kvpool's figure would be the paper's, or that no value tried reaches it.

`capacity` runs on both of the paper's released traces (conversation and synthetic).
"""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from kvpool.engine.emulated.profile import EngineProfile
from kvpool.sim.experiments.common import ExperimentOptions, ExperimentResult
from kvpool.sim.experiments.reach import describe as describe_reach
from kvpool.sim.experiments.verdicts import (
    ABSOLUTE_FLOOR,
    RELATIVE_TOLERANCE,
    in_percent,
    verdict,
)
from kvpool.sim.report import print_result
from kvpool.sim.trace import named_trace_path

__all__ = ["ABSOLUTE_FLOOR", "RELATIVE_TOLERANCE", "comparisons", "plan", "run_all", "verdict"]

Runner = Callable[[ExperimentOptions], ExperimentResult]
LABEL_FIELDS = ("trace", "point", "speed", "admission", "system", "policy", "split", "setting",
                "workload", "input_len", "bandwidth_gbps", "capacity_blocks")
"""Row fields that name a row in the verdict table, in this order, where present."""


def _band_of(row: dict[str, Any], field: str, key: str | None) -> tuple[float, float] | None:
    """The band the row gives for `field` (at `key`): gain_pct_at_ms -> gain_band_pct_at_ms."""
    b = row.get(field.replace("_pct", "_band_pct", 1)) if "_pct" in field else None
    if isinstance(b, dict) and key is not None and isinstance(b.get(key), dict):
        lo, hi = b[key].get("lo"), b[key].get("hi")
        if lo is not None and hi is not None:
            return float(lo), float(hi)
    return None


def _reach_of(row: dict[str, Any], field: str, key: str | None) -> dict[str, Any] | None:
    """The sweep that the row gives for `field` (at `key`): reach_<field>, experiments/reach.py."""
    r = row.get(f"reach_{field}")
    if isinstance(r, dict) and key is not None:
        r = r.get(key)
    return r if isinstance(r, dict) and "assumption" in r else None


def comparisons(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every (kvpool, paper) pair of figures in `rows`, with its verdict."""
    out: list[dict[str, Any]] = []
    for row in rows:
        label = " ".join(str(row[k]) for k in LABEL_FIELDS if row.get(k) is not None)
        for field, paper in row.items():
            if not field.startswith("paper_"):
                continue
            name = field.removeprefix("paper_")
            ours = row.get(name)
            pairs = ([(k, ours.get(k), v) for k, v in paper.items()]
                     if isinstance(paper, dict) and isinstance(ours, dict)
                     else [(None, ours, paper)])
            for key, o, p in pairs:
                if not (isinstance(o, int | float) and isinstance(p, int | float)) or \
                        isinstance(o, bool) or isinstance(p, bool):
                    continue
                band = _band_of(row, name, key)
                said = verdict(float(o), float(p), band, in_percent(name))
                reached = _reach_of(row, name, key)
                if reached and said.startswith("outside"):
                    said += f"; the paper's at {describe_reach(reached)}"
                out.append({"row": label, "figure": name + (f"[{key}]" if key else ""),
                            "kvpool": o, "paper": p,
                            "band": f"{band[0]:g}..{band[1]:g}" if band else "",
                            "verdict": said})
    return out


def plan(experiments: dict[str, Runner], base: ExperimentOptions,
         profile_for: Callable[[str], EngineProfile]
         ) -> list[tuple[str, Runner, ExperimentOptions]]:
    """(title, runner, options) of every run: each experiment on `profile_for(name)`,
    `capacity` on both released traces (unless the base options name a trace)."""
    out: list[tuple[str, Runner, ExperimentOptions]] = []
    for name, runner in experiments.items():
        opts = dataclasses.replace(base, profile=profile_for(name),
                                   out_dir=base.out_dir / name)
        out.append((name, runner, opts))
        if name == "capacity" and base.trace is None:
            synth = dataclasses.replace(opts, trace=named_trace_path("synthetic_trace.jsonl"),
                                        out_dir=base.out_dir / "capacity-synthetic")
            out.append(("capacity (synthetic trace)", runner, synth))
    return out


def run_all(experiments: dict[str, Runner], base: ExperimentOptions,
            profile_for: Callable[[str], EngineProfile],
            log: Callable[[str], None] = lambda _: None) -> Path:
    """Run every experiment and write `report.md` in `base.out_dir`; returns its path."""
    base.out_dir.mkdir(parents=True, exist_ok=True)
    parts = ["# kvpool beside the papers\n",
             "Every experiment of `kvpool sim experiment`, its table, its plot, and each figure "
             "the papers give beside kvpool's with a verdict (within 25%; inside the band over "
             "the calibration's neighbourhood; or outside, with the value of the named "
             "assumption at which kvpool's figure is the paper's where the experiment sweeps "
             "one, experiments/reach.py; docs/sim.md says why).\n"]
    tally: dict[str, int] = {}
    for title, runner, opts in plan(experiments, base, profile_for):
        log(f"running {title}")
        result = runner(opts)
        parts.append(_section(title, result, opts, tally))
    summary = ", ".join(f"{n} {v}" for v, n in sorted(tally.items()))
    parts.insert(2, f"Verdicts: {summary or 'none'}.\n")
    path = base.out_dir / "report.md"
    path.write_text("\n".join(parts))
    return path


def _section(title: str, result: ExperimentResult, opts: ExperimentOptions,
             tally: dict[str, int]) -> str:
    table = io.StringIO()
    print_result(result, table, as_json=False)
    lines = [f"## {title}\n", f"Profile `{opts.profile.name}`"
             + (f", trace `{opts.trace.name}`" if opts.trace else "") + ".\n",
             "```", table.getvalue().rstrip(), "```\n"]
    if result.plot is not None:
        opts.out_dir.mkdir(parents=True, exist_ok=True)
        png = result.plot(opts.out_dir)
        rel = png.relative_to(opts.out_dir.parent) if png.is_relative_to(
            opts.out_dir.parent) else png
        lines.append(f"![{title}]({rel})\n")
    rows = comparisons(result.rows)
    if rows:
        lines += ["| row | figure | kvpool | paper | band | verdict |", "|---|---|---|---|---|---|"]
        for r in rows:
            tally[r["verdict"].split(" (")[0]] = tally.get(r["verdict"].split(" (")[0], 0) + 1
            lines.append(f"| {r['row']} | {r['figure']} | {r['kvpool']:.4g} | {r['paper']:.4g} "
                         f"| {r['band']} | {r['verdict']} |")
        lines.append("")
    return "\n".join(lines)
