"""The eviction mechanism of the master: walk the policy's victims, skip what must stay.

`Evictor` holds eviction's own state (the back-off after a futile round, the counters); the
policy (eviction.py) only orders keys, and the tables change only through their methods.
It is handed the core (through its CoreApi) and the disk tier it offloads victims to.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvpool.store.wire.codes import Tier

if TYPE_CHECKING:
    from kvpool.store.master.core_api import CoreApi
    from kvpool.store.master.state import StoredObject
    from kvpool.store.master.tiering import Tiering


FUTILE_EVICTION_S = 0.05


@dataclass
class EvictionStats:
    objects: int = 0
    bytes: int = 0
    rounds: int = 0


class Evictor:
    """Eviction of one master core, with its own state."""

    def __init__(self, core: CoreApi, tiering: Tiering) -> None:
        self.core = core
        self.tiering = tiering
        self.stats = EvictionStats()
        self._idle_until = 0.0
        """No round after an allocation failure before this (the last one freed nothing)."""

    def target(self) -> int:
        return eviction_target(self.core)

    def evict(self, num_bytes: int) -> bool:
        """Free about `num_bytes` of DRAM (see `evict`); whether anything was freed now."""
        return evict(self.core, self.tiering, num_bytes, self.stats)

    def for_allocation(self, size: int, count: int, now: float) -> bool:
        """Evict after an allocation failure; whether anything was freed. A round that
        freed nothing is not retried for FUTILE_EVICTION_S (with everything leased, every
        failing put would otherwise walk all objects again), and a placement that no
        freeing can satisfy (more replicas than big-enough segments) evicts nothing."""
        if now < self._idle_until:
            return False
        placeable = self.core.segment_list()
        big_enough = sum(1 for s in placeable if s.capacity >= s.allocator.rounded(size))
        if big_enough < count:
            return False
        # only memory a placement can use: not a draining node's objects, which are waiting
        # to be moved, and whose freed space no put is given
        if evict(self.core, self.tiering, max(self.target(), size * count), self.stats,
                 {id(s) for s in placeable}):
            return True
        self._idle_until = now + FUTILE_EVICTION_S
        return False


def eviction_target(core: CoreApi) -> int:
    """Bytes one round frees: eviction_ratio of capacity, or enough to get back under the
    high watermark, whichever is more."""
    cfg = core.config
    capacity = core.capacity_bytes
    above = core.used_bytes - int(cfg.high_watermark * capacity)
    return max(int(cfg.eviction_ratio * capacity), above, 1)


def evict(core: CoreApi, tiering: Tiering, num_bytes: int, stats: EvictionStats,
          on: set[int] | None = None) -> bool:
    """Free about `num_bytes` of DRAM by dropping least valuable objects. Leased,
    hard-pinned and pending objects are never evicted; soft-pinned ones only in a second
    pass. Victims a disk tier takes (tiering.py) are offloaded instead (or, already copied
    ahead, freed at once), and bytes already being offloaded count toward `num_bytes`.
    `on`: ids of the segments whose memory counts (None: every one); objects with none of
    their DRAM there are left alone. Returns whether anything was freed now."""
    stats.rounds += 1
    num_bytes -= tiering.under_way.offloading_bytes
    if num_bytes <= 0:
        return False
    now = core.clock.now()
    chosen: list[StoredObject] = []
    freed = 0
    for second_pass in (False, True):
        # Walk the policy's order lazily (no copy of a million keys), remove afterwards.
        for key in core.policy.victims():
            if freed >= num_bytes:
                break
            obj = core.objects.get(key)
            if obj is None or obj.hard_pinned or obj.lease_until > now \
                    or tiering.evicting(key):
                continue
            if (obj.soft_pin_until > now) != second_pass:
                continue
            dram = _dram_bytes(obj, on)
            if dram:  # (an object only on disk has nothing to give)
                freed += dram
                chosen.append(obj)
        if freed >= num_bytes:
            break
    dropped, freed_now = tiering.take_victims(chosen) if tiering.mounts else (chosen, 0)
    if tiering.mounts:
        tiering.clean_if_wanted()
    for obj in dropped:
        freed_now += _dram_bytes(obj)
        core.remove_object(obj, defer=False)
    stats.objects += len(dropped)
    stats.bytes += freed_now
    return freed_now > 0


def _dram_bytes(obj: StoredObject, on: set[int] | None = None) -> int:
    return sum(r.segment.allocator.rounded(r.size) for r in obj.replicas
               if r.segment.tier is Tier.DRAM and (on is None or id(r.segment) in on))
