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
from kvpool.errors import InvalidArgument


class PrefillPolicy(Protocol):
    def choose(self, req: RequestInfo, match: PrefixMatch, view: ClusterView,
               now: float) -> PrefillChoice: ...


class _Base:
    def __init__(self, cost: CostModel, config: ConductorConfig) -> None:
        self.cost = cost
        self.config = config

    def _tokens(self, req: RequestInfo, blocks: int) -> int:
        return min(blocks * self.config.block_size, req.input_len)

    def local_choice(self, req: RequestInfo, match: PrefixMatch, view: ClusterView,
                     instance_id: int, now: float) -> PrefillChoice:
        prefix = self._tokens(req, match.blocks_on(instance_id))
        return PrefillChoice(instance_id, prefix, prefix, None,
                             view.prefill[instance_id].queue_s(now), 0.0,
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
        best: PrefillChoice | None = None
        for p in view.prefill:
            c = self.local_choice(req, match, view, p.instance_id, now)
            if best is None or c.ttft_s < best.ttft_s:
                best = c
        assert best is not None
        return best


class KVCacheCentricPolicy(_Base):
    """Algorithm 1 of [A]/[F]: global best prefix, transfer cost, balancing threshold.

    For an instance holding `local` leading blocks of a best match of `best` blocks elsewhere,
    the remote prefix is fetched when best / local >= balancing_threshold (local == 0 with
    best > 0 counts as an infinite ratio); otherwise the instance computes from its own prefix.
    A fetched prefix is replicated on the chosen instance (hot-spot migration).
    """

    def choose(self, req: RequestInfo, match: PrefixMatch, view: ClusterView,
               now: float) -> PrefillChoice:
        best: PrefillChoice | None = None
        for p in view.prefill:
            c = self._candidate(req, match, view, p.instance_id, now)
            if best is None or c.ttft_s < best.ttft_s:
                best = c
        assert best is not None
        return best

    def _candidate(self, req: RequestInfo, match: PrefixMatch, view: ClusterView,
                   inst: int, now: float) -> PrefillChoice:
        local = match.blocks_on(inst)
        best, source = match.best_blocks, match.best_instance
        if source is None or best <= local or best < local * self.config.balancing_threshold:
            return self.local_choice(req, match, view, inst, now)
        prefix = self._tokens(req, best)
        local_tokens = self._tokens(req, local)
        nic_wait = max(0.0, view.prefill[source].nic_busy_until_s - now)
        transfer = nic_wait + self.cost.kv_transfer_s(prefix - local_tokens)
        return PrefillChoice(inst, prefix, local_tokens, source, view.prefill[inst].queue_s(now),
                             transfer, self.cost.prefill_with_load_s(req.input_len, prefix))


PolicyFactory = Callable[[CostModel, ConductorConfig], PrefillPolicy]

PREFILL_POLICIES: dict[str, PolicyFactory] = {
    "random": RandomPolicy,
    "round_robin": RoundRobinPolicy,
    "load_balance": LoadBalancePolicy,
    "cache_aware": CacheAwarePolicy,
    "kvcache_centric": KVCacheCentricPolicy,
}


def create_prefill_policy(name: str, cost: CostModel, config: ConductorConfig) -> PrefillPolicy:
    try:
        factory = PREFILL_POLICIES[name]
    except KeyError:
        raise InvalidArgument(
            f"unknown prefill policy {name!r}; choose one of {sorted(PREFILL_POLICIES)}") from None
    return factory(cost, config)
