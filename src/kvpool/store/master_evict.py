"""The eviction mechanism of the master: walk the policy's victims, skip what must stay."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvpool.store.master_core import MasterCore



def eviction_target(core: MasterCore) -> int:
    """Bytes one round frees: eviction_ratio of capacity, or enough to get back under the
    high watermark, whichever is more."""
    cfg = core.config
    above = core.used_bytes - int(cfg.high_watermark * core._capacity)
    return max(int(cfg.eviction_ratio * core._capacity), above, 1)


def evict(core: MasterCore, num_bytes: int) -> bool:
    """Free about `num_bytes` by dropping least valuable objects. Leased, hard-pinned and
    pending objects are never evicted; soft-pinned ones only in a second pass. Returns
    whether anything was freed."""
    core.stats.eviction_rounds += 1
    now = core.clock.now()
    freed = 0
    for second_pass in (False, True):
        for key in core.policy.victims():
            if freed >= num_bytes:
                break
            obj = core.objects.get(key)
            if obj is None or obj.hard_pinned or obj.lease_until > now:
                continue
            if (obj.soft_pin_until > now) != second_pass:
                continue
            freed += sum(r.segment.allocator.rounded(r.size) for r in obj.replicas)
            core._remove_object(obj, defer=False)
            core.stats.evicted_objects += 1
        if freed >= num_bytes:
            break
    core.stats.evicted_bytes += freed
    return freed > 0
