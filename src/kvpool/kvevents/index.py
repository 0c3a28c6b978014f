"""Which blocks each instance holds, per medium, learned from its KV events.

`CacheIndex` is the only writer of its tables: `apply` folds one batch of an instance's
events in, `clear` forgets an instance (a resync), `matched_blocks` answers how many leading
blocks of a request's hash chain the instance holds on a medium. Thread-safe: a subscriber
thread applies while the conductor asks.

Hash sanity: a router that computes hashes differently from its engines sees zero hits and
nothing else. `note_lookup(instance, hashes)` records the chain a request sent to that
instance was computed to have; a BlockStored whose hashes meet a recently noted chain (or a
lookup that meets stored blocks) is a match. `never_matched(instance)` is true once
`alarm_after_lookups` lookups were noted while the instance had stored blocks and no match
ever happened: its events and the computed hashes disagree (algorithm, seed, block size or
int/bytes form) and routing on them is blind.

Only KV-cache group 0 (or events without a group) is indexed: the full-attention group of a
hybrid model; other groups' blocks are ignored.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvpool.errors import InvalidArgument
from kvpool.kvevents.events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    EventBatch,
    normalize_medium,
)
from kvpool.log import get_logger

log = get_logger("kvevents.index")
RECENT_LOOKUP_HASHES = 4096
"""How many recently noted computed hashes each instance remembers for the match check."""


@dataclass
class IndexStats:
    """Counters of one instance (a snapshot: `CacheIndex.stats` returns a copy)."""

    num_stored_events: int = 0
    num_removed_events: int = 0
    num_cleared_events: int = 0
    num_lookups: int = 0
    num_lookups_with_blocks: int = 0
    num_matches: int = 0
    num_unmatched_stored_events: int = 0
    """BlockStored events, after the first lookup, none of whose hashes was computed here."""


@dataclass
class _Instance:
    blocks: dict[str, set[BlockHash]] = field(default_factory=dict)
    recent: deque[BlockHash] = field(default_factory=deque)
    recent_set: set[BlockHash] = field(default_factory=set)
    stats: IndexStats = field(default_factory=IndexStats)


class CacheIndex:
    def __init__(self, alarm_after_lookups: int = 16) -> None:
        if alarm_after_lookups < 1:
            raise InvalidArgument(f"alarm_after_lookups must be >= 1, got {alarm_after_lookups}")
        self.alarm_after_lookups = alarm_after_lookups
        self._instances: dict[str, _Instance] = {}
        self._lock = threading.Lock()

    # -- actions ---------------------------------------------------------------------------

    def apply(self, instance: str, batch: EventBatch) -> None:
        """Fold `batch` (one publish of `instance`, in order) into the index."""
        with self._lock:
            state = self._instances.setdefault(instance, _Instance())
            for event in batch.events:
                if isinstance(event, BlockStored):
                    self._stored(state, event)
                elif isinstance(event, BlockRemoved):
                    self._removed(state, event)
                elif isinstance(event, AllBlocksCleared):
                    state.stats.num_cleared_events += 1
                    state.blocks.clear()

    def clear(self, instance: str) -> None:
        """Forget every block of `instance` (it rejoined or lost events); counters stay."""
        with self._lock:
            state = self._instances.setdefault(instance, _Instance())
            state.blocks.clear()

    def drop(self, instance: str) -> None:
        """Forget `instance` entirely (it left the fleet)."""
        with self._lock:
            self._instances.pop(instance, None)

    def note_lookup(self, instance: str, hashes: Sequence[BlockHash]) -> None:
        """Record that a request with this computed chain was sent to `instance`."""
        with self._lock:
            state = self._instances.setdefault(instance, _Instance())
            state.stats.num_lookups += 1
            tiers = [held for held in state.blocks.values() if held]
            if tiers:
                state.stats.num_lookups_with_blocks += 1
            if any(h in held for held in tiers for h in hashes):
                state.stats.num_matches += 1
            s = state.stats
            if s.num_matches == 0 and s.num_lookups_with_blocks == self.alarm_after_lookups:
                log.warning("KV events of %s never match a computed block hash (%d lookups, "
                            "%d stored events): check its hash algorithm, PYTHONHASHSEED, block "
                            "size and VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", instance,
                            s.num_lookups, s.num_stored_events)
            for h in hashes:
                if h not in state.recent_set:
                    state.recent.append(h)
                    state.recent_set.add(h)
            while len(state.recent) > RECENT_LOOKUP_HASHES:
                state.recent_set.discard(state.recent.popleft())

    # -- questions -------------------------------------------------------------------------

    def matched_blocks(
        self, instance: str, hashes: Sequence[BlockHash], medium: str = MEDIUM_GPU
    ) -> int:
        """How many leading blocks of `hashes` `instance` holds on `medium` (0: unknown)."""
        return self.matched_on_any(instance, hashes, (medium,))

    def matched_on_any(self, instance: str, hashes: Sequence[BlockHash], media: Sequence[str]) -> int:
        """How many leading blocks of `hashes` `instance` holds, each on one of `media` (a
        pool's chain may lie partly in DRAM, partly on disk)."""
        with self._lock:
            state = self._instances.get(instance)
            tiers = [held for m in media if state and (held := state.blocks.get(normalize_medium(m)))]
            count = 0
            for h in hashes:
                if not any(h in held for held in tiers):
                    break
                count += 1
            return count

    def instances(self) -> list[str]:
        with self._lock:
            return sorted(self._instances)

    def num_blocks(self, instance: str, medium: str = MEDIUM_GPU) -> int:
        with self._lock:
            state = self._instances.get(instance)
            return len(state.blocks.get(normalize_medium(medium), ())) if state else 0

    def media(self, instance: str) -> list[str]:
        with self._lock:
            state = self._instances.get(instance)
            return sorted(m for m, held in state.blocks.items() if held) if state else []

    def never_matched(self, instance: str) -> bool:
        """True when lookups met stored blocks often enough and no hash ever matched."""
        with self._lock:
            state = self._instances.get(instance)
            if state is None:
                return False
            s = state.stats
            return s.num_matches == 0 and s.num_lookups_with_blocks >= self.alarm_after_lookups

    def stats(self, instance: str) -> IndexStats:
        with self._lock:
            state = self._instances.get(instance)
            return IndexStats(**vars(state.stats)) if state else IndexStats()

    def check_integrity(self) -> None:
        """AssertionError unless the recent-lookup set mirrors its queue."""
        with self._lock:
            for name, state in self._instances.items():
                assert set(state.recent) == state.recent_set, f"{name}: recent set drifted"
                assert len(state.recent) <= RECENT_LOOKUP_HASHES, f"{name}: recent overflow"

    # -- helpers (under the lock) ----------------------------------------------------------

    def _stored(self, state: _Instance, event: BlockStored) -> None:
        state.stats.num_stored_events += 1
        if event.group_idx not in (None, 0):
            return
        state.blocks.setdefault(normalize_medium(event.medium), set()).update(event.block_hashes)
        if not state.stats.num_lookups:
            return
        if any(h in state.recent_set for h in event.block_hashes):
            state.stats.num_matches += 1
        else:
            state.stats.num_unmatched_stored_events += 1

    def _removed(self, state: _Instance, event: BlockRemoved) -> None:
        state.stats.num_removed_events += 1
        if event.group_idx not in (None, 0):
            return
        held = state.blocks.get(normalize_medium(event.medium))
        if held:
            held.difference_update(event.block_hashes)
