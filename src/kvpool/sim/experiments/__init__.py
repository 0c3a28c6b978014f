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
DEFAULT_PROFILES = {"long-context": BASE_PROFILE, "public-datasets": BASE_PROFILE}
"""Experiments whose default profile is not SIM_PROFILE. The joint fit (Fig.1 + Fig.7) puts
3-4 ms on every sequence of a decode step, which caps an instance near 260 tokens/s; [A]
Fig.12's Mooncake-[3P+1D] sustains 1.25 RPS x 511 tokens = 640 tokens/s on one decode instance
at 16k. [A]'s synthetic experiments contradict that term, so they keep the papers'
microbenchmark costs (docs/sim.md, section 6); `--profile llama70b-8xa800-joint` runs them on
the joint fit."""


def default_profile(name: str) -> str:
    """The profile experiment `name` runs on unless `--profile` says otherwise."""
    return DEFAULT_PROFILES.get(name, SIM_PROFILE)


__all__ = ["EXPERIMENTS", "ExperimentOptions", "ExperimentResult", "default_profile"]
