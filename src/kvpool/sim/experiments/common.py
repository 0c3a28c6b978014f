"""Shared pieces of the paper experiments: options, result rows, and run helpers."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from tqdm import tqdm

from kvpool.conductor import CostModel
from kvpool.engine.emulated.profile import EngineProfile, load_profile
from kvpool.sim.disagg import DisaggConfig
from kvpool.sim.metrics import SimResult
from kvpool.sim.systems import run_disagg
from kvpool.sim.trace import TraceRequest, load_trace, speed_up

T = TypeVar("T")

SIM_PROFILE = "llama70b-8xa800-joint"
"""The experiments' default profile: the papers' cost model with its decode terms fitted on
Mooncake's Fig.1 and Fig.7 curves at once (`kvpool sim calibrate --joint`, docs/sim.md)."""
NO_SLO_S = 1e9
"""A TTFT limit that never rejects: experiments that measure latency serve every request."""


@dataclass(frozen=True, slots=True)
class ExperimentOptions:
    trace: Path | None = None
    """Mooncake-format JSONL; None = the conversation trace."""
    limit: int | None = None
    """Use only the first N requests (quick runs)."""
    out_dir: Path = Path("out")
    progress: bool = True
    speed: float | None = None
    """Replay speed-up; None = the experiment's own default."""
    profile: EngineProfile = field(default_factory=lambda: load_profile(SIM_PROFILE))
    """Cost model and engine terms of every run (`--profile`; `--cost` replaces its cost)."""
    band: bool = True
    """Rerun on every fit of the profile's calibration neighbourhood and report the range of
    the results that depend on the decode cost (experiments/band.py; `--no-band`)."""
    reach: bool = True
    """For a gain outside 25% of the paper's and outside the band, sweep the one named
    assumption that moves it and report the value reaching the paper's (experiments/reach.py;
    `--no-reach`)."""

    @property
    def cost(self) -> CostModel:
        return self.profile.cost

    def run_disagg(self, reqs: Sequence[TraceRequest], config: DisaggConfig | None = None,
                   cost: CostModel | None = None, **conductor: Any) -> SimResult:
        """One disaggregated run on the profile's cost (or `cost`); keyword arguments go to
        ConductorConfig."""
        return run_disagg(reqs, cost or self.cost, config, **conductor)

    def requests(self, default_speed: float = 1.0) -> list[TraceRequest]:
        reqs = load_trace(self.trace, self.limit)
        factor = self.speed if self.speed is not None else default_speed
        return speed_up(reqs, factor) if factor != 1.0 else reqs


@dataclass(slots=True)
class ExperimentResult:
    name: str
    title: str
    columns: list[str]
    rows: list[dict[str, Any]]
    notes: list[str] = field(default_factory=list)
    plot: Callable[[Path], Path] | None = None
    """Writes the experiment's PNG into the given directory and returns its path."""
    table_rows: list[dict[str, Any]] | None = None
    """Rows of the printed table when they differ from the JSON rows (flattened, with the
    paper's rows added); None = `rows`."""


def runs(items: Sequence[T], progress: bool, desc: str) -> Iterable[T]:
    return tqdm(items, desc=desc, unit="run", disable=not progress, leave=False)


def pct_change(ours: float, base: float) -> float | None:
    return None if base == 0 else 100.0 * (ours / base - 1.0)


def rnd(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)
