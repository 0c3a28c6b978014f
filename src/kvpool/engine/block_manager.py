"""The paged KV cache's bookkeeping: which block holds what, who uses it, which are reusable.

Pure mechanism, in question/action pairs (`can_allocate` / `allocate`, `can_append` / `append`).
A full, computed block is registered under its chained prefix hash (`blocks.py`); when its last
user lets go it stays in the free list with its hash, so a later prompt with the same prefix
takes it back (tokens are compared on a hit, so a hash collision is a miss, never wrong KV).
Free blocks are reused least recently freed first; reusing one drops its hash.

Every change of the hashed set is an event `(hash, stored)` with a sequence number, so a reader
(the proxy's prefix index) follows the set by deltas (`events_since`) and resyncs from
`cached_hashes` when it fell behind the bounded log.
"""


from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from dataclasses import dataclass

from kvpool.engine.sequence import Sequence

MAX_EVENTS = 200_000
"""Events kept for readers that poll; one who fell further behind reads the whole set."""


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: tuple[int, ...] = ()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._by_hash: dict[int, int] = {}
        self._events: deque[tuple[int, bool]] = deque(maxlen=MAX_EVENTS)
        self.num_events = 0
        """Events ever recorded: the sequence number of the next one."""

    # -- questions -------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def cached_hashes(self) -> list[int]:
        return list(self._by_hash)

    def events_since(self, seq: int) -> list[tuple[int, bool]] | None:
        """(hash, stored) events from number `seq` on, in order; None when they are no longer
        all kept (or `seq` is from the future): read `cached_hashes` instead."""
        first = self.num_events - len(self._events)
        if not first <= seq <= self.num_events:
            return None
        return list(itertools.islice(self._events, seq - first, None))

    def _log(self, block_hash: int, stored: bool) -> None:
        self._events.append((block_hash, stored))
        self.num_events += 1

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Leading blocks of `seq` held here, leaving at least one token to compute."""
        limit = (len(seq) - 1) // self.block_size
        hits: list[int] = []
        for i, h in enumerate(seq.block_hashes[:limit]):
            block_id = self._by_hash.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tuple(seq.block_tokens(i)):
                break
            hits.append(block_id)
        return hits

    def can_allocate(self, seq: Sequence, hits: list[int]) -> bool:
        reused_free = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        return seq.num_blocks_needed - len(hits) + reused_free <= self.num_free_blocks

    def can_append(self, seq: Sequence) -> bool:
        return len(seq) <= len(seq.block_table) * self.block_size or self.num_free_blocks > 0

    # -- actions ---------------------------------------------------------------------------

    def allocate(self, seq: Sequence, hits: list[int]) -> None:
        """Give `seq` the hit blocks (already computed) plus fresh ones for the rest."""
        assert not seq.block_table
        for block_id in hits:
            self._take(block_id)
        seq.block_table = list(hits)
        seq.block_table += [self._take_fresh() for _ in range(seq.num_blocks_needed - len(hits))]
        seq.num_computed_tokens = seq.num_cached_tokens = len(hits) * self.block_size
        seq.num_committed_blocks = len(hits)

    def allocate_blocks(self, num_blocks: int) -> list[int]:
        """Fresh blocks for KV that arrives from elsewhere (a push reservation)."""
        return [self._take_fresh() for _ in range(num_blocks)]

    def append(self, seq: Sequence) -> None:
        """Make room for the token at position len(seq) - 1."""
        if len(seq) > len(seq.block_table) * self.block_size:
            seq.block_table.append(self._take_fresh())

    def commit(self, seq: Sequence) -> None:
        """Register the hashes of `seq`'s blocks that are now full and computed."""
        full = min(seq.num_computed_tokens // self.block_size, len(seq.block_hashes))
        for i in range(seq.num_committed_blocks, full):
            block = self.blocks[seq.block_table[i]]
            if seq.block_hashes[i] not in self._by_hash:
                block.hash, block.token_ids = seq.block_hashes[i], tuple(seq.block_tokens(i))
                self._by_hash[block.hash] = block.block_id
                self._log(block.hash, True)
        seq.num_committed_blocks = max(seq.num_committed_blocks, full)

    def free(self, seq: Sequence) -> None:
        self.release(seq.block_table)
        seq.block_table = []
        seq.num_committed_blocks = 0

    def release(self, block_ids: list[int]) -> None:
        """Drop one reference to each block; the last blocks of a prefix are reused first."""
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1

    def _take_fresh(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:
            del self._by_hash[block.hash]
            self._log(block.hash, False)
            block.hash, block.token_ids = None, ()
        block.ref_count = 1
        return block_id

    def check_integrity(self) -> None:
        for block in self.blocks:
            assert block.ref_count >= 0, block
            assert (block.ref_count == 0) == (block.block_id in self._free), block
            if block.hash is not None:
                assert self._by_hash[block.hash] == block.block_id, block
        assert all(self.blocks[b].hash == h for h, b in self._by_hash.items())
