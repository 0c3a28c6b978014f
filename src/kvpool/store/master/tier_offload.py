"""Offload: DRAM objects to disk, at eviction or ahead of it; the write side of tiering.py,
as functions over the tier's state (tier_state.py), which they change only through its
tables' methods (tier_tables.py).

Eviction must never wait for the disk (a put that finds DRAM full is answered at once), yet
an object evicted while no disk copy exists can only be dropped or copied first. So the
master keeps the cold end of each DRAM eviction order *clean*: the objects that eviction
would take next, up to `clean_share` of DRAM capacity, get a disk replica while they stay
in DRAM (an OFFLOAD task with `evict` False). Eviction then frees their DRAM at once (no
copy needed), and a victim whose copy is still under way is marked to be freed when it
lands. The walk runs at every tick and, at most every `clean_interval_s`, after an
eviction round or a node's report: as fast as the node writes, never faster than it
reports.

    eviction order:  [ cold ............................................. hot ]
                     |<-- clean_share x capacity -->|
                       on disk too, or being copied
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvpool.store.master.tier_tasks import DELETE, OFFLOAD, Task
from kvpool.store.wire.codes import Tier

if TYPE_CHECKING:
    from kvpool.store.master.state import StoredObject
    from kvpool.store.master.tier_state import TierState


def take_victims(t: TierState, victims: list[StoredObject]) -> tuple[list[StoredObject], int]:
    """Handle DRAM eviction victims: (the ones to drop as before, DRAM bytes freed here).
    Objects on disk (clean) lose their DRAM copy at once; one whose copy ahead is under way
    is freed when it lands; others are offloaded where a disk tier has room."""
    drop, freed = [], 0
    if victims:
        t.under_way.want_walk()
    for obj in victims:
        copying = t.under_way.offloading.get(obj.key)
        if obj.key in t.on_disk.tiered:
            freed += t.drop_dram(obj)
            t.stats.dram_dropped += 1
        elif copying is not None:
            t.under_way.evict_when_copied(copying)
        elif t.on_disk.take_failed(obj.key) or not start_offload(t, obj):
            drop.append(obj)
    return drop, freed


def start_offload(t: TierState, obj: StoredObject, evict: bool = True) -> bool:
    """Queue OFFLOAD of `obj`'s DRAM replica on a node with a disk tier. A copy ahead of
    eviction (`evict` False) takes only free disk space, never evicts disk replicas."""
    for r in obj.replicas:
        mount = t.disk_of(r.segment.client_id)
        if mount is None or r.segment.tier is not Tier.DRAM:
            continue
        ssd = t.allocate_disk(mount, obj.size) if evict else t.free_disk(mount, obj.size)
        if ssd is None:
            return False
        gen = t.new_gen()
        t.under_way.start_offload(t.queue(mount, OFFLOAD, obj.key, obj, obj.size, gen, r, ssd),
                                  evict)
        return True
    return False


def offload_done(t: TierState, task: Task, ok: bool) -> None:
    """The node's outcome of an OFFLOAD: the object gains its disk replica (and, for an
    eviction, loses its DRAM ones), unless it changed meanwhile or the copy failed."""
    obj, ssd = task.obj, task.ssd
    assert ssd is not None
    t.under_way.untrack_offload(task)
    live = t.core.segments.get(ssd.segment.segment_id) is ssd.segment
    valid = ok and live and obj is not None and t.core.objects.get(task.key) is obj \
        and task.dram in obj.replicas
    if not valid:
        t.core.space.free(ssd.segment, ssd.offset)
        if ok and live:
            t.queue(t.mounts[ssd.segment.segment_id], DELETE, task.key, None, 0, task.gen)
        if not ok and obj is not None:
            t.on_disk.offload_failed(task.key)
            t.stats.offload_failures += 1
        return
    assert obj is not None
    t.core.objects.add_replica(obj, ssd)
    t.on_disk.add(task.key, ssd.segment.segment_id, task.gen)
    t.stats.offloads += 1
    if task.evict:
        t.drop_dram(obj)
    else:
        t.stats.copied_ahead += 1
        t.journal_put(obj)


def clean_ahead(t: TierState) -> int:
    """Queue copies of the coldest DRAM objects that have no disk replica, until the clean
    share of DRAM capacity is covered or the in-flight cap is reached (objects no disk
    has free space for are left to eviction); returns the number queued."""
    core, cfg, under_way = t.core, t.config, t.under_way
    due = core.clock.now() + cfg.clean_interval_s
    target = int(cfg.clean_share * core.capacity_bytes)
    budget = cfg.max_cleaning - under_way.num_cleaning
    under_way.plan_walk(due, budget <= 0)  # at the cap: walk again when copies land
    if not t.mounts or target <= 0 or budget <= 0:
        return 0
    covered = queued = 0
    objects, tiered, offloading = core.objects, t.on_disk.tiered, under_way.offloading
    failed = t.on_disk.failed
    for key in core.policy.victims():
        if covered >= target or queued >= budget:
            break
        obj = objects.get(key)
        if obj is None or obj.hard_pinned:
            continue
        covered += obj.size  # (its DRAM bytes, unless it has more than one replica)
        if key in tiered or key in offloading or key in failed:
            continue
        queued += start_offload(t, obj, evict=False)  # False: no disk (room) for it
    under_way.plan_walk(due, queued >= budget)
    return queued
