"""The papers' experiments, by name (`kvpool sim experiment NAME`)."""

from __future__ import annotations

from collections.abc import Callable

from kvpool.sim.experiments import ablation, capacity, hit_rate, overload, scheduling, sweeps
from kvpool.sim.experiments.common import ExperimentOptions, ExperimentResult

EXPERIMENTS: dict[str, Callable[[ExperimentOptions], ExperimentResult]] = {
    "hit-rate": hit_rate.run,
    "scheduling": scheduling.run,
    "capacity": capacity.run,
    "capacity-ablation": ablation.run,
    "overload": overload.run,
    "pd-ratio": sweeps.run_pd_ratio,
    "global-vs-local": sweeps.run_global_vs_local,
    "bandwidth": sweeps.run_bandwidth,
}

__all__ = ["EXPERIMENTS", "ExperimentOptions", "ExperimentResult"]
