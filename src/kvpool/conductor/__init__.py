"""kvpool.conductor: KVCache-centric scheduling as pure logic over a cluster view and a clock.

Shared by the simulator (kvpool.sim) and the live proxy. See docs/conductor.md.
"""

from kvpool.conductor.admission import ADMISSION_POLICIES, create_admission
from kvpool.conductor.conductor import Conductor
from kvpool.conductor.config import ConductorConfig
from kvpool.conductor.cost import CostModel, fit_prefill, load_cost_model
from kvpool.conductor.prefill import PREFILL_POLICIES, create_prefill_policy
from kvpool.conductor.types import (
    Accepted,
    Decision,
    DecodeChoice,
    PrefillChoice,
    Rejected,
    RequestInfo,
)
from kvpool.conductor.view import (
    ClusterView,
    DecodeLoad,
    PrefillLoad,
    PrefixIndex,
    PrefixLookup,
    PrefixMatch,
)

__all__ = [
    "ADMISSION_POLICIES", "PREFILL_POLICIES", "Accepted", "ClusterView", "Conductor",
    "ConductorConfig", "CostModel", "Decision", "DecodeChoice", "DecodeLoad", "PrefillChoice",
    "PrefillLoad", "PrefixIndex", "PrefixLookup", "PrefixMatch", "Rejected", "RequestInfo", "create_admission",
    "create_prefill_policy", "fit_prefill", "load_cost_model",
]
