"""Prefill instance selection policies, swapped by name through PREFILL_POLICIES.

Every policy returns a PrefillChoice whose TTFT is queue + transfer + prefill time. Policies that
ignore the cache still reuse whatever prefix the chosen instance holds locally: the engine always
reuses its own cache; only the choice of instance differs.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import NamedTuple, Protocol

from kvpool.conductor.config import ConductorConfig
from kvpool.conductor.cost import CostModel
from kvpool.conductor.types import PrefillChoice, RequestInfo
from kvpool.conductor.view import ClusterView, PrefixMatch
from kvpool.registry import lookup


class PrefillPolicy(Protocol):
    def choose(self, req: RequestInfo, match: PrefixMatch, view: ClusterView,
               now: float) -> PrefillChoice: ...


class _Base:
    def __init__(self, cost: CostModel, config: ConductorConfig) -> None:
        self.cost = cost
        self.config = config

    def _tokens(self, req: RequestInfo, blocks: int) -> int:
        return min(blocks * self.config.block_size, req.input_len)

    def _reach(self, req: RequestInfo, match: PrefixMatch, local_blocks: int) -> tuple[int, int, float]:
        """(prefix tokens, local prefix tokens, load s) of an instance holding `local_blocks`:
        its engine loads from the pool whatever the pool holds past its own prefix."""
        local = self._tokens(req, local_blocks)
        pooled = self._tokens(req, match.pool_blocks)
        if pooled <= local:
            return local, local, 0.0
        return pooled, local, self.cost.kv_transfer_s(pooled - local)

    def local_choice(self, req: RequestInfo, match: PrefixMatch, view: ClusterView,
                     instance_id: int, now: float) -> PrefillChoice:
        prefix, local, load_s = self._reach(req, match, match.blocks_on(instance_id))
        return PrefillChoice(instance_id, prefix, local, None,
                             view.prefill[instance_id].queue_s(now), load_s,
                             self.cost.prefill_with_load_s(req.input_len, prefix))


class RandomPolicy(_Base):
    def __init__(self, cost: CostModel, config: ConductorConfig) -> None:
        super().__init__(cost, config)
        self._rng = random.Random(config.seed)

    def choose(self, req: RequestInfo, match: PrefixMatch, view: ClusterView,
               now: float) -> PrefillChoice:
        inst = self._rng.randrange(len(view.prefill))
        return self.local_choice(req, match, view, inst, now)


class RoundRobinPolicy(_Base):
    def __init__(self, cost: CostModel, config: ConductorConfig) -> None:
        super().__init__(cost, config)
        self._next = 0

    def choose(self, req: RequestInfo, match: PrefixMatch, view: ClusterView,
               now: float) -> PrefillChoice:
        inst = self._next % len(view.prefill)
        self._next = inst + 1
        return self.local_choice(req, match, view, inst, now)


class LoadBalancePolicy(_Base):
    """Shortest predicted queue; ties go to the lowest instance id."""

    def choose(self, req: RequestInfo, match: PrefixMatch, view: ClusterView,
               now: float) -> PrefillChoice:
        inst = min(view.prefill, key=lambda p: (p.busy_until_s, p.instance_id)).instance_id
        return self.local_choice(req, match, view, inst, now)


class _Plan(NamedTuple):
    """How an instance holding some leading blocks would prefill: the prefix it reuses, of
    which its own, the seconds to get the rest of the prefix (the pool's load or a fetch)
    and to compute, and the instance fetched from (None: its own cache and the pool)."""

    prefix: int
    local: int
    transfer_s: float
    prefill_s: float
    source: int | None
    wait_s: float = 0.0
    """The fetch's wait for the source's NIC."""


class _LowestTtft(_Base):
    """The instance with the lowest queue + transfer + prefill, planned once per distinct
    local prefix length by `_plan`."""

    def choose(self, req: RequestInfo, match: PrefixMatch, view: ClusterView,
               now: float) -> PrefillChoice:
        plans: dict[int, _Plan] = {}
        best_ttft, best_inst, best_local = 0.0, -1, 0
        for p in view.prefill:
            local = match.lens.get(p.instance_id, 0)
            plan = plans.get(local)
            if plan is None:
                plan = plans[local] = self._plan(req, match, view, local, now)
            ttft = max(0.0, p.busy_until_s - now) + plan.wait_s + plan.transfer_s + plan.prefill_s
            if best_inst < 0 or ttft < best_ttft:
                best_ttft, best_inst, best_local = ttft, p.instance_id, local
        plan = plans[best_local]
        return PrefillChoice(best_inst, plan.prefix, plan.local, plan.source,
                             view.prefill[best_inst].queue_s(now), plan.transfer_s,
                             plan.prefill_s, plan.wait_s)

    def _plan(self, req: RequestInfo, match: PrefixMatch, view: ClusterView, local: int,
              now: float) -> _Plan:
        """The instance's own prefix and what its engine loads from the pool."""
        prefix, local_tokens, load_s = self._reach(req, match, local)
        return _Plan(prefix, local_tokens, load_s,
                     self.cost.prefill_with_load_s(req.input_len, prefix), None)


class CacheAwarePolicy(_LowestTtft):
    """Lowest queue + prefill time using each instance's own cached prefix (and the pool's)."""


class KVCacheCentricPolicy(_LowestTtft):
    """Algorithm 1 of [A]/[F]: global best prefix, transfer cost, balancing threshold.

    For an instance holding `local` leading blocks of a best match of `best` blocks elsewhere,
    the remote prefix is fetched when best / local >= balancing_threshold (local == 0 with
    best > 0 counts as an infinite ratio); otherwise the instance computes from its own prefix
    (and what the pool holds). A fetched prefix is replicated on the chosen instance (hot-spot
    migration).
    """

    def _plan(self, req: RequestInfo, match: PrefixMatch, view: ClusterView, local: int,
              now: float) -> _Plan:
        """Or a longer prefix fetched from the instance that holds it."""
        best, source = match.best_blocks, match.best_instance
        if (source is None or best <= max(local, match.pool_blocks)
                or best < local * self.config.balancing_threshold):
            return super()._plan(req, match, view, local, now)
        prefix, local_tokens = self._tokens(req, best), self._tokens(req, local)
        nic_wait = max(0.0, view.prefill[source].nic_busy_until_s - now)
        return _Plan(prefix, local_tokens, self.cost.kv_transfer_s(prefix - local_tokens),
                     self.cost.prefill_with_load_s(req.input_len, prefix), source, nic_wait)


PolicyFactory = Callable[[CostModel, ConductorConfig], PrefillPolicy]

PREFILL_POLICIES: dict[str, PolicyFactory] = {
    "random": RandomPolicy,
    "round_robin": RoundRobinPolicy,
    "load_balance": LoadBalancePolicy,
    "cache_aware": CacheAwarePolicy,
    "kvcache_centric": KVCacheCentricPolicy,
}


def create_prefill_policy(name: str, cost: CostModel, config: ConductorConfig) -> PrefillPolicy:
    return lookup(PREFILL_POLICIES, "prefill policy", name)(cost, config)
