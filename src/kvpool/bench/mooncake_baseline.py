"""The regression guard of `kvpool bench mooncake-api`: a checked-in baseline of its
kvpool / Mooncake ratios, and the comparison of a run against it.

A run's figure for one case (operation, mode, object size, keys per call) is the median of
its per-round ratios (kvpool and Mooncake measured moments apart, so a load change on the
machine hits both). The baseline keeps, per case, the figure of each recorded run; its band
is their lowest to highest, i.e. how far the machine's noise moved the figure while nothing
changed. A run regresses on a case when its figure falls below the band's low end by more
than `tolerance` (a fraction of it). Cases present on one side only are not compared, so a
run with other sizes is compared on what it shares with the baseline.

The ratios move with the machine's load (on a crowded machine Mooncake's busy-polling
threads lose more than kvpool's clients, or less, case by case), so a run is compared with
the runs recorded in its own regime: quiet (the higher of its 1-min load averages at the start
and the end at most one per CPU) or crowded. A baseline without runs of the run's regime
is compared whole.

File format (JSON): {"command": [...], "runs": [{"load": [1 min at start, at end], "cpus": N,
"ratios": {case: ratio}}]}, a case written "op mode size batch" (e.g. "put_from batched 65536
32", batch 1 for single keys; "cpus" absent: the comparing machine's). Pure functions here; the
bench does the I/O.
"""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from kvpool.errors import ConfigError
from kvpool.units import format_size

Case = tuple[str, str, int, int]
"""(op, mode, object size in bytes, keys per call)."""

DEFAULT_TOLERANCE = 0.2
QUIET_LOAD_PER_CPU = 1.0
"""A run whose higher 1-min load average (start, end) is at most this per CPU is quiet."""


def default_path() -> Path:
    """The baseline shipped with kvpool (kvpool/data/bench/mooncake_api_baseline.json)."""
    return Path(str(resources.files("kvpool.data").joinpath(
        "bench", "mooncake_api_baseline.json")))


@dataclass(frozen=True)
class Band:
    """The recorded figures of one case: lowest, median and highest over `runs` runs (of
    `regime`, or "any")."""

    low: float
    median: float
    high: float
    runs: int
    regime: str = "any"


def regime(load: Sequence[float], cpus: int) -> str:
    """quiet or crowded: a run's 1-min load averages (start, end) on `cpus` CPUs."""
    return "quiet" if max(load) <= QUIET_LOAD_PER_CPU * cpus else "crowded"


@dataclass(frozen=True)
class Verdict:
    case: Case
    ratio: float
    band: Band
    floor: float
    """The lowest ratio that passes: band.low x (1 - tolerance)."""

    @property
    def regressed(self) -> bool:
        return self.ratio < self.floor


def case_name(case: Case) -> str:
    op, mode, size, batch = case
    return f"{op} {mode} {size} {batch}"


def parse_case(name: str) -> Case:
    parts = name.split()
    if len(parts) != 4 or not parts[2].isdigit() or not parts[3].isdigit():
        raise ConfigError(f"baseline case {name!r} is not 'op mode size batch'")
    return parts[0], parts[1], int(parts[2]), int(parts[3])


def run_figures(round_ratios: Mapping[tuple[str, str, int], Sequence[float]],
                batch: int) -> dict[Case, float]:
    """Per case, the median of a run's per-round ratios (bench's round_ratios)."""
    return {(op, mode, size, batch if mode == "batched" else 1): statistics.median(values)
            for (op, mode, size), values in round_ratios.items() if values}


def bands(baseline: Mapping[str, Any], load: Sequence[float] | None = None,
          cpus: int = 1) -> dict[Case, Band]:
    """Each case's band over the baseline's recorded runs: with a run's `load` (on `cpus`
    CPUs), over those of its regime if the baseline has any."""
    runs, which = list(baseline.get("runs", [])), "any"
    if load is not None:
        which = regime(load, cpus)
        alike = [r for r in runs if "load" in r and
                 regime(r["load"], int(r.get("cpus", cpus))) == which]
        runs, which = (alike, which) if alike else (runs, "any")
    figures: dict[Case, list[float]] = {}
    for run in runs:
        for name, ratio in run["ratios"].items():
            figures.setdefault(parse_case(name), []).append(float(ratio))
    return {case: Band(min(v), statistics.median(v), max(v), len(v), which)
            for case, v in figures.items()}


def compare(figures: Mapping[Case, float], baseline: Mapping[str, Any],
            tolerance: float = DEFAULT_TOLERANCE, load: Sequence[float] | None = None,
            cpus: int = 1) -> list[Verdict]:
    """A verdict for each case of the run that the baseline holds, in the run's order,
    against the runs of the run's regime (`bands`)."""
    if not 0 <= tolerance < 1:
        raise ConfigError(f"tolerance must be in [0, 1), got {tolerance}")
    known = bands(baseline, load, cpus)
    return [Verdict(case, ratio, known[case], known[case].low * (1 - tolerance))
            for case, ratio in figures.items() if case in known]


def add_run(baseline: Mapping[str, Any] | None, figures: Mapping[Case, float],
            command: Sequence[str], load: Sequence[float], cpus: int) -> dict[str, Any]:
    """The baseline with one more run recorded (a new one when `baseline` is None)."""
    out = {"command": list(command), "runs": list((baseline or {}).get("runs", []))}
    out["runs"].append({"load": [round(x, 2) for x in load], "cpus": cpus,
                        "ratios": {case_name(c): round(r, 3) for c, r in figures.items()}})
    return out


def load(path: Path) -> dict[str, Any]:
    """A baseline file, checked: ConfigError naming the file when it is unreadable or not
    in the format above."""
    try:
        data = json.loads(path.read_text())
        runs = data["runs"]
        if not isinstance(runs, list) or not all(isinstance(r["ratios"], dict) for r in runs):
            raise TypeError("runs must be a list of objects with a 'ratios' object")
        for run in runs:
            _check_machine(run)
            for name, ratio in run["ratios"].items():
                parse_case(name)
                if not isinstance(ratio, int | float) or ratio <= 0:
                    raise TypeError(f"ratio of {name!r} is not a positive number")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"baseline {path}: {exc}") from exc
    return data


def _check_machine(run: Mapping[str, Any]) -> None:
    """A run's `load` (two load averages) and `cpus` (a positive count), where given."""
    load = run.get("load")
    if load is not None and (not isinstance(load, list) or len(load) != 2 or
                             not all(isinstance(x, int | float) and x >= 0 for x in load)):
        raise TypeError(f"load {load!r} is not [1-min load at the start, at the end]")
    cpus = run.get("cpus", 1)
    if not isinstance(cpus, int) or isinstance(cpus, bool) or cpus < 1:
        raise TypeError(f"cpus {cpus!r} is not a positive count")


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity), which the load average is shared by."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def report(verdicts: Sequence[Verdict], tolerance: float) -> list[str]:
    """One line per verdict: REGRESSION where the figure fell below its floor, ok else."""
    lines = []
    for v in verdicts:
        op, mode, size, batch = v.case
        what = f"{op} {mode} {format_size(size)}" + (f" x{batch}" if mode == "batched" else "")
        word = "REGRESSION" if v.regressed else "ok"
        lines.append(f"{word:10} {what:28} kv/mc {v.ratio:5.2f}  floor {v.floor:5.2f}  (band "
                     f"{v.band.low:.2f}-{v.band.high:.2f} over {v.band.runs} "
                     f"{'' if v.band.regime == 'any' else v.band.regime + ' '}runs, "
                     f"-{tolerance:.0%})")
    return lines
