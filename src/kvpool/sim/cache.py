"""A block cache of bounded capacity with a named eviction policy.

Mechanism: `prefix_blocks` asks how many leading blocks are present; `access` touches present
blocks and inserts missing ones, evicting by policy. Policies (EVICTION_POLICIES):

- `lru`: least recently used first.
- `lfu`: lowest access count first, then least recently used.
- `length_aware`: like LFU, but among equally frequent blocks the one that sits later in its
  request goes first (later blocks are shared by fewer requests).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Protocol

from kvpool.errors import ConfigError, InvalidArgument
from kvpool.registry import lookup


class EvictionPolicy(Protocol):
    def touch(self, block: int, pos: int) -> None: ...
    def insert(self, block: int, pos: int) -> None: ...
    def victim(self) -> int: ...
    def __len__(self) -> int: ...


class LRUPolicy:
    def __init__(self) -> None:
        self._order: OrderedDict[int, None] = OrderedDict()

    def touch(self, block: int, pos: int) -> None:
        self._order.move_to_end(block)

    def insert(self, block: int, pos: int) -> None:
        self._order[block] = None

    def victim(self) -> int:
        return self._order.popitem(last=False)[0]

    def __len__(self) -> int:
        return len(self._order)


class _HeapPolicy:
    """Lazy-deletion heap keyed by `_key`; the live key of each block is kept in `_keys`."""

    def __init__(self) -> None:
        self._heap: list[tuple[tuple[int, ...], int]] = []
        self._keys: dict[int, tuple[int, ...]] = {}
        self._freq: dict[int, int] = {}
        self._pos: dict[int, int] = {}
        self._seq = 0

    def _key(self, block: int) -> tuple[int, ...]:
        raise NotImplementedError

    def _push(self, block: int) -> None:
        self._seq += 1
        key = self._key(block)
        self._keys[block] = key
        heapq.heappush(self._heap, (key, block))
        if len(self._heap) > 4 * len(self._keys) + 64:
            self._heap = [(k, b) for b, k in self._keys.items()]
            heapq.heapify(self._heap)

    def touch(self, block: int, pos: int) -> None:
        self._freq[block] += 1
        self._push(block)

    def insert(self, block: int, pos: int) -> None:
        self._freq[block] = 1
        self._pos[block] = pos
        self._push(block)

    def victim(self) -> int:
        while True:
            key, block = heapq.heappop(self._heap)
            if self._keys.get(block) == key:
                del self._keys[block], self._freq[block], self._pos[block]
                return block

    def __len__(self) -> int:
        return len(self._keys)


class LFUPolicy(_HeapPolicy):
    def _key(self, block: int) -> tuple[int, ...]:
        return (self._freq[block], self._seq)


class LengthAwarePolicy(_HeapPolicy):
    def _key(self, block: int) -> tuple[int, ...]:
        return (self._freq[block], -self._pos[block], self._seq)


EVICTION_POLICIES: dict[str, Callable[[], EvictionPolicy]] = {
    "lru": LRUPolicy,
    "lfu": LFUPolicy,
    "length_aware": LengthAwarePolicy,
}

EvictHook = Callable[[int], None]


class BlockCache:
    """`capacity_blocks=None` means unlimited. `on_insert`/`on_evict` keep an index in step."""

    def __init__(self, capacity_blocks: int | None, policy: str = "lru",
                 on_insert: EvictHook | None = None, on_evict: EvictHook | None = None) -> None:
        if capacity_blocks is not None and capacity_blocks <= 0:
            raise ConfigError(f"capacity_blocks must be > 0 or None, got {capacity_blocks}")
        factory = lookup(EVICTION_POLICIES, "eviction policy", policy)
        self.capacity_blocks = capacity_blocks
        self.policy_name = policy
        self._policy = factory()
        self._blocks: set[int] = set()
        self._on_insert = on_insert
        self._on_evict = on_evict
        self.num_evicted = 0

    def __contains__(self, block: int) -> bool:
        return block in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def blocks(self) -> frozenset[int]:
        return frozenset(self._blocks)

    def prefix_blocks(self, hashes: Sequence[int]) -> int:
        n = 0
        for h in hashes:
            if h not in self._blocks:
                break
            n += 1
        return n

    def access(self, hashes: Sequence[int]) -> int:
        """Touch or insert every block of a request; returns its leading hit blocks (before)."""
        hits = self.prefix_blocks(hashes)
        for pos, h in enumerate(hashes):
            if h in self._blocks:
                self._policy.touch(h, pos)
            else:
                self._insert(h, pos)
        return hits

    def resize(self, capacity_blocks: int) -> None:
        """Change the capacity, evicting by policy down to it at once."""
        if capacity_blocks <= 0:
            raise InvalidArgument(f"capacity_blocks must be > 0, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        while len(self._blocks) > capacity_blocks:
            self._evict_one()

    def _evict_one(self) -> None:
        victim = self._policy.victim()
        self._blocks.discard(victim)
        self.num_evicted += 1
        if self._on_evict is not None:
            self._on_evict(victim)

    def _insert(self, block: int, pos: int) -> None:
        if self.capacity_blocks is not None and len(self._blocks) >= self.capacity_blocks:
            self._evict_one()
        self._blocks.add(block)
        self._policy.insert(block, pos)
        if self._on_insert is not None:
            self._on_insert(block)

    def check_integrity(self) -> None:
        assert len(self._policy) == len(self._blocks), (len(self._policy), len(self._blocks))
        if self.capacity_blocks is not None:
            assert len(self._blocks) <= self.capacity_blocks


def hit_rate(requests: Sequence[Sequence[int]], capacity_blocks: int | None,
             policy: str = "lru") -> float:
    """Share of block references that are prefix hits in one global cache, in trace order."""
    cache = BlockCache(capacity_blocks, policy)
    hits = total = 0
    for hashes in requests:
        hits += cache.access(hashes)
        total += len(hashes)
    return hits / total if total else 0.0
