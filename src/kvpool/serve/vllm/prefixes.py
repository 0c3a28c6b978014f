"""Which leading blocks of a request each vLLM prefill instance holds, and the shared pool, as
the conductor asks it (`PrefixLookup`), from an index KV events fill
(kvpool.kvevents.CacheIndex).

    HeldBlocks        the seam: what the index answers per instance (named by its URL, the
                      topic it publishes under) and for the pool (the master's topic)
    InstancePrefixes  a PrefixLookup over it for the prefill instances in rotation (instance id
                      = position in the cluster view), and the note of where a request went,
                      which the index's hash check counts

vLLM instances cannot fetch a prefix from one another's GPU cache: a match names no source
instance (`best_instance` None), so the conductor reuses an instance's own prefix where it is
held. The pool is the one place every instance loads from (its MooncakeStoreConnector): the
leading blocks the pool holds, in DRAM or on disk, are `pool_blocks`, which reach every
instance at the transfer cost.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kvpool.conductor import PrefixMatch
from kvpool.kvevents.events import MEDIUM_CPU, MEDIUM_DISK

POOL_MEDIA = (MEDIUM_CPU, MEDIUM_DISK)


class HeldBlocks(Protocol):
    def matched_blocks(self, instance: str, hashes: Sequence[int]) -> int:
        """How many leading blocks of `hashes` the instance's cache holds (0: none, unknown)."""

    def matched_on_any(self, instance: str, hashes: Sequence[int], media: Sequence[str]) -> int:
        """The same, each block on one of `media`."""

    def note_lookup(self, instance: str, hashes: Sequence[int]) -> None:
        """A request with this computed chain was sent to the instance (for the hash check)."""


class InstancePrefixes:
    """`pool_topic`: the topic the pool's events arrive under ("" = no pool)."""

    def __init__(self, held: HeldBlocks, instances: Sequence[str], pool_topic: str = "") -> None:
        self.held = held
        self.instances = list(instances)
        self.pool_topic = pool_topic

    def match(self, block_hashes: Sequence[int]) -> PrefixMatch:
        lens = {i: n for i, name in enumerate(self.instances)
                if (n := self.held.matched_blocks(name, block_hashes)) > 0}
        pooled = (self.held.matched_on_any(self.pool_topic, block_hashes, POOL_MEDIA)
                  if self.pool_topic else 0)
        return PrefixMatch(lens, max(lens.values(), default=0), None, pooled)

    def routed(self, instance_id: int, block_hashes: Sequence[int]) -> None:
        if block_hashes:
            self.held.note_lookup(self.instances[instance_id], block_hashes)
