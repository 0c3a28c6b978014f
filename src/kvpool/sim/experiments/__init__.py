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

A_PROFILE = "llama70b-8xa800"
DEFAULT_PROFILES = {"long-context": A_PROFILE, "public-datasets": A_PROFILE,
                    "real-workload": A_PROFILE}
"""Experiments whose default profile is not SIM_PROFILE. [A]'s experiments ran on the cluster
of [A]'s own microbenchmarks (Fig.2) and publish no measurement of Mooncake's TBT to fit, so
they run on the papers' microbenchmark costs; the Fig.1 fit (SIM_PROFILE) describes [F]'s
end-to-end cluster (docs/sim.md, section 6)."""


def default_profile(name: str) -> str:
    """The profile experiment `name` runs on unless `--profile` says otherwise."""
    return DEFAULT_PROFILES.get(name, SIM_PROFILE)


__all__ = ["EXPERIMENTS", "ExperimentOptions", "ExperimentResult", "default_profile"]
