"""Read-only views of the master for the admin HTTP server and the metrics: one object, a
page of keys, and a snapshot of the counts and counters."""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvpool.store.master.core import MasterCore, MasterStats
from kvpool.store.master.evict import EvictionStats
from kvpool.store.master.tier_tasks import TierStats
from kvpool.store.wire.codes import ObjectInfo, SegmentInfo


def object_info(core: MasterCore, key: str) -> ObjectInfo | None:
    obj = core.objects.get(key)
    if obj is None:
        return None
    now = core.clock.now()
    return ObjectInfo(key, obj.size, tuple(r.desc() for r in obj.replicas),
                      obj.lease_until > now, obj.hard_pinned, obj.soft_pin_until > now)


def list_keys(core: MasterCore, prefix: str = "", limit: int = 1000) -> list[str]:
    """Up to `limit` stored keys starting with `prefix`, in insertion order."""
    out = []
    for key in core.objects:
        if key.startswith(prefix):
            out.append(key)
            if len(out) >= limit:
                break
    return out


@dataclass(frozen=True)
class MasterSnapshot:
    """What /health, /segments and /metrics show: copied under the master's lock by
    `snapshot`, then read (and rendered) without it, so a scrape never walks live tables."""

    keys: int
    pending: int
    clients: int
    capacity_bytes: int
    used_bytes: int
    segments: tuple[SegmentInfo, ...]
    stats: MasterStats
    eviction: EvictionStats
    tier: TierStats
    disk_only_keys: int
    offloading_bytes: int
    loading: int


def snapshot(core: MasterCore) -> MasterSnapshot:
    """A copy of the master's counts and counters (call it under the master's lock)."""
    tiering = core.tiering
    return MasterSnapshot(
        len(core.objects), len(core.pending), len(core.clients), core.capacity_bytes,
        core.used_bytes, tuple(core.segment_infos()), replace(core.stats),
        replace(core.evictor.stats), replace(tiering.stats),
        sum(1 for k in tiering.on_disk.tiered if len(core.objects[k].replicas) == 1),
        tiering.under_way.offloading_bytes, len(tiering.under_way.loading))
