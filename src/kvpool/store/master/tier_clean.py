"""Copying DRAM objects to disk ahead of their eviction: the write-back side of tiering.py.

Eviction must never wait for the disk (a put that finds DRAM full is answered at once), yet
an object evicted while no disk copy exists can only be dropped or copied first. So the
master keeps the cold end of each DRAM eviction order *clean*: the objects that eviction
would take next, up to `clean_share` of DRAM capacity, get a disk replica while they stay
in DRAM (an OFFLOAD task with `evict` False). Eviction then frees their DRAM at once (no
copy needed), and a victim whose copy is still under way is marked to be freed when it
lands. The walk runs at every tick and, at most every `clean_interval_s`, after a node
reported: as fast as the node writes, never faster than it reports.

    eviction order:  [ cold ............................................. hot ]
                     |<-- clean_share x capacity -->|
                       on disk too, or being copied
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvpool.store.wire.codes import Tier

if TYPE_CHECKING:
    from kvpool.store.master.tier_tasks import Task
    from kvpool.store.master.tiering import Tiering


def clean_ahead(t: Tiering) -> int:
    """Queue copies of the coldest DRAM objects that have no disk replica, until the clean
    share of DRAM capacity is covered or the in-flight cap is reached (objects no disk
    has free space for are left to eviction); returns the number queued."""
    core, cfg = t.core, t.config
    t.clean_due = core.clock.now() + cfg.clean_interval_s
    target = int(cfg.clean_share * core.capacity_bytes)
    budget = cfg.max_cleaning - t.num_cleaning
    if not t.mounts or target <= 0 or budget <= 0:
        return 0
    covered = queued = 0
    for key in core.policy.victims():
        if covered >= target or queued >= budget:
            break
        obj = core.objects.get(key)
        if obj is None or obj.hard_pinned:
            continue
        covered += sum(r.size for r in obj.replicas if r.segment.tier is Tier.DRAM)
        if key in t.tiered or key in t.offloading or key in t.failed:
            continue
        queued += t._start_offload(obj, evict=False)  # False: no disk (room) for it
    return queued


def evict_when_copied(t: Tiering, task: Task) -> None:
    """Eviction chose an object whose copy ahead is under way: free its DRAM when the copy
    lands (its bytes now count as being offloaded)."""
    if not task.evict:
        task.evict = True
        t.num_cleaning -= 1
        t.offloading_bytes += task.size
