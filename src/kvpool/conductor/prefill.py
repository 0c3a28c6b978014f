"""Prefill instance selection policies, swapped by name through PREFILL_POLICIES.

Every policy returns a PrefillChoice whose TTFT is queue + transfer + prefill time. Policies that
ignore the cache still reuse whatever prefix the chosen instance holds locally: the engine always
reuses its own cache; only the choice of instance differs.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Protocol

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


class CacheAwarePolicy(_Base):
    """Lowest queue + prefill time using each instance's own cached prefix only."""

    def choose(self, req: RequestInfo, match: PrefixMatch, view: ClusterView,
               now: float) -> PrefillChoice:
        plans: dict[int, tuple[int, int, float, float]] = {}
        best_ttft, best_inst, best_local = 0.0, -1, 0
        for p in view.prefill:
            local = match.lens.get(p.instance_id, 0)
            plan = plans.get(local)
            if plan is None:
                prefix, local_tokens, load_s = self._reach(req, match, local)
                plan = plans[local] = (prefix, local_tokens, load_s,
                                       self.cost.prefill_with_load_s(req.input_len, prefix))
            ttft = max(0.0, p.busy_until_s - now) + plan[2] + plan[3]
            if best_inst < 0 or ttft < best_ttft:
                best_ttft, best_inst, best_local = ttft, p.instance_id, local
        prefix, local_tokens, load_s, prefill_s = plans[best_local]
        return PrefillChoice(best_inst, prefix, local_tokens, None,
                             view.prefill[best_inst].queue_s(now), load_s, prefill_s)


class KVCacheCentricPolicy(_Base):
    """Algorithm 1 of [A]/[F]: global best prefix, transfer cost, balancing threshold.

    For an instance holding `local` leading blocks of a best match of `best` blocks elsewhere,
    the remote prefix is fetched when best / local >= balancing_threshold (local == 0 with
    best > 0 counts as an infinite ratio); otherwise the instance computes from its own prefix.
    A fetched prefix is replicated on the chosen instance (hot-spot migration). Work that only
    depends on the local prefix length is computed once per distinct length.
    """

    def choose(self, req: RequestInfo, match: PrefixMatch, view: ClusterView,
               now: float) -> PrefillChoice:
        plans: dict[int, tuple[int, int, float, float]] = {}
        best_ttft, best_inst, best_local = 0.0, -1, 0
        for p in view.prefill:
            local = match.lens.get(p.instance_id, 0)
            plan = plans.get(local)
            if plan is None:
                plan = plans[local] = self._plan(req, match, view, local, now)
            ttft = max(0.0, p.busy_until_s - now) + plan[2] + plan[3]
            if best_inst < 0 or ttft < best_ttft:
                best_ttft, best_inst, best_local = ttft, p.instance_id, local
        prefix, local_tokens, transfer, prefill = plans[best_local]
        source = match.best_instance if prefix > local_tokens else None
        return PrefillChoice(best_inst, prefix, local_tokens, source,
                             view.prefill[best_inst].queue_s(now), transfer, prefill)

    def _plan(self, req: RequestInfo, match: PrefixMatch, view: ClusterView, local: int,
              now: float) -> tuple[int, int, float, float]:
        """(prefix tokens, local prefix tokens, transfer s, prefill s) for `local` blocks: the
        instance's own prefix and what its engine loads from the pool, or a longer prefix
        fetched from the instance that holds it."""
        best, source = match.best_blocks, match.best_instance
        reach, local_tokens, load_s = self._reach(req, match, local)
        if (source is None or best <= max(local, match.pool_blocks)
                or best < local * self.config.balancing_threshold):
            return reach, local_tokens, load_s, self.cost.prefill_with_load_s(req.input_len, reach)
        prefix = self._tokens(req, best)
        nic_wait = max(0.0, view.prefill[source].nic_busy_until_s - now)
        transfer = nic_wait + self.cost.kv_transfer_s(prefix - local_tokens)
        return prefix, local_tokens, transfer, self.cost.prefill_with_load_s(req.input_len, prefix)


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
