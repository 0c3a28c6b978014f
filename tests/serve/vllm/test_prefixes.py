"""The conductor's prefix match over vLLM instances' KV events: `InstancePrefixes` over a real
`CacheIndex` (instance ids are positions in the cluster view, names are the instances' URLs),
the blocks the pool holds (its own topic, DRAM or disk), and the note of where a request went,
which the index's hash check counts. vLLM instances cannot fetch from one another: a match
names no source instance."""

from __future__ import annotations

from kvpool.conductor import PrefixMatch
from kvpool.kvevents.events import BlockRemoved, BlockStored, EventBatch
from kvpool.kvevents.hashing import BlockHasher
from kvpool.kvevents.index import CacheIndex
from kvpool.serve.vllm.prefixes import InstancePrefixes

A, B, C = "http://a:1", "http://b:1", "http://c:1"
POOL = "kvpool-pool"


def stored(index: CacheIndex, instance: str, hashes: list[int]) -> None:
    index.apply(instance, EventBatch(ts=0.0, events=[BlockStored(block_hashes=list(hashes))]))


def test_leading_blocks_per_instance_in_view_order() -> None:
    hasher = BlockHasher("sha256", 4)
    chain = hasher.block_hashes(list(range(16)))  # 4 blocks
    index = CacheIndex()
    stored(index, A, chain[:2])
    stored(index, B, chain)
    stored(index, C, chain[1:])  # not a leading run
    prefixes = InstancePrefixes(index, [C, A, B])
    assert prefixes.match(chain) == PrefixMatch({1: 2, 2: 4}, 4, None)
    index.apply(B, EventBatch(ts=1.0, events=[BlockRemoved(block_hashes=[chain[2]])]))
    assert prefixes.match(chain) == PrefixMatch({1: 2, 2: 2}, 2, None)
    assert InstancePrefixes(index, [C]).match(chain) == PrefixMatch({}, 0, None)


def test_the_pool_s_leading_blocks_across_dram_and_disk() -> None:
    chain = BlockHasher("sha256", 4).block_hashes(list(range(20)))  # 5 blocks
    index = CacheIndex()
    stored(index, A, chain[:1])
    for medium, blocks in (("cpu", chain[:2]), ("disk", chain[2:3]), ("cpu", chain[4:])):
        index.apply(POOL, EventBatch(ts=0.0, events=[BlockStored(block_hashes=list(blocks),
                                                                 medium=medium)]))
    assert InstancePrefixes(index, [A], POOL).match(chain) == PrefixMatch({0: 1}, 1, None, 3)
    assert InstancePrefixes(index, [A]).match(chain) == PrefixMatch({0: 1}, 1, None, 0)
    stored(index, POOL, chain[3:4])  # an instance's GPU medium under the pool's topic: not the pool
    assert InstancePrefixes(index, [A], POOL).match(chain).pool_blocks == 3
    index.apply(POOL, EventBatch(ts=1.0, events=[BlockRemoved(block_hashes=[chain[0]], medium="cpu")]))
    assert InstancePrefixes(index, [A], POOL).match(chain).pool_blocks == 0


def test_routed_requests_feed_the_hash_check() -> None:
    index = CacheIndex(alarm_after_lookups=2)
    stored(index, A, [11, 12])
    prefixes = InstancePrefixes(index, [A])
    prefixes.routed(0, [99])
    prefixes.routed(0, [])  # nothing computed (a salted request): not a lookup
    assert not index.never_matched(A)
    prefixes.routed(0, [98])
    assert index.never_matched(A)
    prefixes.routed(0, [11])
    assert not index.never_matched(A)
