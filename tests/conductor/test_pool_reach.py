"""A prefix held by a shared pool (PrefixMatch.pool_blocks) reaches every prefill instance at
the transfer cost: every policy's TTFT counts it, and kvcache_centric weighs it against a
holder's cache. Block size 512, prefill 1 ms per new token, transfer 1 us per token."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kvpool.conductor import Accepted, Conductor, ConductorConfig, CostModel, PrefixMatch
from tests.conductor.conftest import req, view_with


class Fixed:
    def __init__(self, match: PrefixMatch) -> None:
        self.fixed = match

    def match(self, block_hashes: Sequence[int]) -> PrefixMatch:
        return self.fixed


def choose(cost: CostModel, policy: str, match: PrefixMatch, busy: Sequence[float] = (0.0, 0.0)):
    view = view_with({})
    for p, b in zip(view.prefill, busy, strict=True):
        p.busy_until_s = b
    d = Conductor(ConductorConfig(prefill_policy=policy, admission="none"), cost).schedule(
        req(0, [1, 2, 3, 4, 5]), view, 0.0, Fixed(match))
    assert isinstance(d, Accepted)
    return d.prefill


@pytest.mark.parametrize("policy", ["load_balance", "round_robin", "random", "cache_aware",
                                    "kvcache_centric"])
def test_every_policy_counts_the_pool_prefix(cost: CostModel, policy: str) -> None:
    p = choose(cost, policy, PrefixMatch({}, 0, None, pool_blocks=3))
    # 1536 tokens loaded (1.536 ms), 1024 computed (1.024 s)
    assert (p.prefix_len, p.local_prefix_len, p.source_id) == (1536, 0, None)
    assert p.transfer_s == pytest.approx(0.001536)
    assert p.prefill_s == pytest.approx(1.024)
    assert not p.replicate


def test_a_cached_prefix_longer_than_the_pool_s_is_not_loaded(cost: CostModel) -> None:
    p = choose(cost, "cache_aware", PrefixMatch({1: 4}, 4, None, pool_blocks=2))
    assert (p.instance_id, p.prefix_len, p.local_prefix_len, p.transfer_s) == (1, 2048, 2048, 0.0)
    assert p.ttft_s == pytest.approx(0.512)


def test_kvcache_centric_takes_the_pool_to_an_idle_instance(cost: CostModel) -> None:
    """Instance 0 holds 4 blocks but is busy 2 s; the pool holds 3: instance 1 loads them and
    computes 1024 tokens (1.024 s + 1.536 ms) rather than wait (2 s + 0.512 s)."""
    p = choose(cost, "kvcache_centric", PrefixMatch({0: 4}, 4, None, pool_blocks=3), (2.0, 0.0))
    assert (p.instance_id, p.prefix_len, p.local_prefix_len, p.source_id) == (1, 1536, 0, None)
    assert p.ttft_s == pytest.approx(1.025536)


def test_kvcache_centric_prefers_the_holder_over_a_shorter_pool_prefix(cost: CostModel) -> None:
    p = choose(cost, "kvcache_centric", PrefixMatch({0: 4}, 4, None, pool_blocks=3), (0.1, 0.0))
    assert (p.instance_id, p.prefix_len, p.transfer_s) == (0, 2048, 0.0)
    assert p.ttft_s == pytest.approx(0.1 + 0.512)


def test_without_a_pool_nothing_changes(cost: CostModel) -> None:
    """No holder to fetch from (best_instance None) and no pool: instance 1 would compute all
    2560 tokens (2.56 s), so the holder is worth its 2 s queue (2 s + 0.512 s)."""
    p = choose(cost, "kvcache_centric", PrefixMatch({0: 4}, 4, None), (2.0, 0.0))
    assert (p.instance_id, p.prefix_len, p.transfer_s, p.source_id) == (0, 2048, 0.0, None)
    assert p.ttft_s == pytest.approx(2.512)


def test_a_prefix_the_pool_gives_is_not_fetched_from_its_holder(cost: CostModel) -> None:
    """Instance 0 holds 3 blocks (fetchable), the pool 3 too: instance 1 loads them from the
    pool, so no source is named and nothing is replicated."""
    p = choose(cost, "kvcache_centric", PrefixMatch({0: 3}, 3, 0, pool_blocks=3), (2.0, 0.0))
    assert (p.instance_id, p.prefix_len, p.local_prefix_len, p.source_id) == (1, 1536, 0, None)
    assert not p.replicate and p.transfer_s == pytest.approx(0.001536)
