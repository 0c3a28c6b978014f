"""Shared pieces of the paper experiments: options, result rows, and run helpers."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from tqdm import tqdm

from kvpool.conductor import Conductor, ConductorConfig, CostModel
from kvpool.sim.colocated import ColocatedConfig, ColocatedSim
from kvpool.sim.disagg import DisaggConfig, DisaggSim
from kvpool.sim.metrics import SimResult
from kvpool.sim.trace import TraceRequest, load_trace, speed_up

T = TypeVar("T")

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
    cost: CostModel = field(default_factory=CostModel)
    """Cost model of every run (the calibrated defaults, or one fitted with `fit_prefill`)."""

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


def runs(items: Sequence[T], progress: bool, desc: str) -> Iterable[T]:
    return tqdm(items, desc=desc, unit="run", disable=not progress, leave=False)


def run_disagg(reqs: Sequence[TraceRequest], cost: CostModel | None = None,
               config: DisaggConfig | None = None, **conductor: Any) -> SimResult:
    """One disaggregated run; keyword arguments go to ConductorConfig."""
    return DisaggSim(Conductor(ConductorConfig(**conductor), cost or CostModel()),
                     config).run(reqs)


def run_colocated(reqs: Sequence[TraceRequest], config: ColocatedConfig,
                  cost: CostModel | None = None) -> SimResult:
    return ColocatedSim(cost or CostModel(), config).run(reqs)


def pct_change(ours: float, base: float) -> float | None:
    return None if base == 0 else 100.0 * (ours / base - 1.0)


def rnd(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)
