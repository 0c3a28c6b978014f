"""Which leading blocks of a request each vLLM prefill instance holds, as the conductor asks it
(`PrefixLookup`), from an index its KV events fill (kvpool.kvevents.CacheIndex).

    HeldBlocks        the seam: what the index answers per instance (named by its URL, the
                      topic it publishes under)
    InstancePrefixes  a PrefixLookup over it for the prefill instances in rotation (instance id
                      = position in the cluster view), and the note of where a request went,
                      which the index's hash check counts
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kvpool.conductor import PrefixMatch


class HeldBlocks(Protocol):
    def matched_blocks(self, instance: str, hashes: Sequence[int]) -> int:
        """How many leading blocks of `hashes` the instance's cache holds (0: none, unknown)."""

    def note_lookup(self, instance: str, hashes: Sequence[int]) -> None:
        """A request with this computed chain was sent to the instance (for the hash check)."""


class InstancePrefixes:
    def __init__(self, held: HeldBlocks, instances: Sequence[str]) -> None:
        self.held = held
        self.instances = list(instances)

    def match(self, block_hashes: Sequence[int]) -> PrefixMatch:
        lens = {i: n for i, name in enumerate(self.instances)
                if (n := self.held.matched_blocks(name, block_hashes)) > 0}
        if not lens:
            return PrefixMatch({}, 0, None)
        best = max(lens.values())
        return PrefixMatch(lens, best, min(i for i, n in lens.items() if n == best))

    def routed(self, instance_id: int, block_hashes: Sequence[int]) -> None:
        if block_hashes:
            self.held.note_lookup(self.instances[instance_id], block_hashes)
