"""The systems the capacity experiments compare, each built from one accelerator profile so
that every system runs on the same terms ([F] 5.2: Mooncake 8P8D against 16 colocated vLLM
v0.5.1 instances, plain, with prefix caching, and with chunked prefill).

The profile's decode terms (fitted on Mooncake's own curve by `kvpool sim calibrate`) price
every system's decode steps; `CostModel.decode_join_s` applies only where KV arrives from
another instance (Mooncake's decode pool, sim/engine.py `remote_kv`); `chunk_tokens` and
`chunk_overhead_s` only to chunked prefill.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvpool.conductor import Conductor, ConductorConfig, CostModel
from kvpool.engine.emulated.profile import EngineProfile
from kvpool.errors import InvalidArgument
from kvpool.sim.colocated import ColocatedConfig, ColocatedSim
from kvpool.sim.disagg import DisaggConfig, DisaggSim
from kvpool.sim.engine import EngineConfig
from kvpool.sim.metrics import SimResult
from kvpool.sim.trace import TraceRequest
from kvpool.sim.vllm import VllmConfig

SYSTEM_NAMES = ("mooncake", "vllm", "vllm_prefix", "vllm_chunked")
TTFT_LIMIT_S = 30.0
"""[F] 5.1: the TTFT limit of every capacity figure."""
ADMISSION_TBT_S = 1.0
"""The TBT limit Mooncake's admission runs with in the capacity figures: the largest threshold
drawn, since one run gives the whole curve (the paper's Mooncake reaches 100% by 300 ms)."""
VLLM_PREFIX_BLOCKS = 2539
"""vLLM's GPU prefix cache: the whole VRAM KV capacity (1.3M tokens) in 512-token blocks."""


def colocated_config(name: str, profile: EngineProfile) -> ColocatedConfig:
    """The vLLM variant `name` (vllm, vllm_prefix, vllm_chunked) on `profile`'s terms."""
    vllm = VllmConfig(chunk_overhead_s=profile.chunk_overhead_s)
    if name == "vllm":
        return ColocatedConfig(vllm=vllm)
    if name == "vllm_prefix":
        return ColocatedConfig(engine=EngineConfig(prefix_cache_blocks=VLLM_PREFIX_BLOCKS),
                               vllm=vllm)
    if name == "vllm_chunked":
        return ColocatedConfig(engine=EngineConfig(chunk_tokens=profile.chunk_tokens), vllm=vllm)
    raise InvalidArgument(f"unknown system {name!r}; known: {', '.join(SYSTEM_NAMES)}")


def run_disagg(reqs: Sequence[TraceRequest], cost: CostModel,
               config: DisaggConfig | None = None, **conductor: Any) -> SimResult:
    """One disaggregated run on `cost`; keyword arguments go to ConductorConfig."""
    return DisaggSim(Conductor(ConductorConfig(**conductor), cost), config).run(reqs)


def run_mooncake(reqs: Sequence[TraceRequest], profile: EngineProfile,
                 config: DisaggConfig | None = None, **conductor: Any) -> SimResult:
    """Mooncake as the capacity figures run it: 8P8D, kvcache_centric, early rejection on the
    30 s TTFT limit (keyword arguments override ConductorConfig fields)."""
    settings: dict[str, Any] = {"admission": "early_rejection", "ttft_slo_s": TTFT_LIMIT_S,
                                "tbt_slo_s": ADMISSION_TBT_S, **conductor}
    return run_disagg(reqs, profile.cost, config, **settings)


def run_system(name: str, reqs: Sequence[TraceRequest],
               profile: EngineProfile) -> tuple[SimResult, ColocatedSim | None]:
    """One capacity run of system `name`; the colocated simulator is returned for its
    VRAM and preemption figures (None for Mooncake)."""
    if name == "mooncake":
        return run_mooncake(reqs, profile), None
    sim = ColocatedSim(profile.cost, colocated_config(name, profile))
    return sim.run(reqs), sim
