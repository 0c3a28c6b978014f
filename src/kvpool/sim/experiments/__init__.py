"""The papers' experiments, by name (`kvpool sim experiment NAME`)."""

from __future__ import annotations

from collections.abc import Callable

from kvpool.sim.experiments import (
    ablation,
    arxiv,
    capacity,
    hit_rate,
    overload,
    realworld,
    scheduling,
    sweeps,
)
from kvpool.sim.experiments.common import SIM_PROFILE, ExperimentOptions, ExperimentResult

EXPERIMENTS: dict[str, Callable[[ExperimentOptions], ExperimentResult]] = {
    "hit-rate": hit_rate.run,
    "scheduling": scheduling.run,
    "capacity": capacity.run,
    "capacity-ablation": ablation.run,
    "overload": overload.run,
    "pd-ratio": sweeps.run_pd_ratio,
    "global-vs-local": sweeps.run_global_vs_local,
    "bandwidth": sweeps.run_bandwidth,
    "long-context": arxiv.run_long_context,
    "public-datasets": arxiv.run_public_datasets,
    "real-workload": realworld.run,
}

BASE_PROFILE = "llama70b-8xa800"
DEFAULT_PROFILES: dict[str, str] = {}
"""Experiments whose default profile is not SIM_PROFILE: none. The joint calibration fits one
set of hardware terms on two workloads (conversation and synthetic), so every experiment, the
synthetic workloads of [A] 8.1 included, runs on it; `--profile llama70b-8xa800` gives the
papers' microbenchmark costs (docs/sim.md, section 6)."""


def default_profile(name: str) -> str:
    """The profile experiment `name` runs on unless `--profile` says otherwise."""
    return DEFAULT_PROFILES.get(name, SIM_PROFILE)


__all__ = ["EXPERIMENTS", "ExperimentOptions", "ExperimentResult", "default_profile"]
