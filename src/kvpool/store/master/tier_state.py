"""The state of the master's disk tier and the actions on it that its two halves share:
nodes and their task queues, offloads and loads under way, which keys are on disk, disk
space and disk eviction. `Tiering` (tiering.py) adds the requests and hooks that run the
offload side (tier_offload.py) and the read side (tier_reads.py) over this state; those
two modules import this one, never tiering.py.

Rule: one writer per table. The state is five tables, each the only writer of its fields:
the mounts (`mounts`, written here; each `SsdMount` writes its own task queue), the keys on
disk (`on_disk`, a `DiskKeys`), the transfers under way (`under_way`, a `TierTransfers`;
both in tier_tables.py), the files of lost disks (`left`, a `LeftFiles`, tier_left.py). The offload and read sides read their fields and change them only
through their methods; `stats` holds counters that either side adds to. `check_integrity`
checks each table and then the tables against the object table.
"""

from __future__ import annotations

import itertools
import random
from typing import TYPE_CHECKING

from kvpool.store.master.state import Replica, Segment, StoredObject
from kvpool.store.master.tier_left import LeftFiles
from kvpool.store.master.tier_tables import DiskKeys, TierTransfers
from kvpool.store.master.tier_tasks import (
    DELETE,
    LOAD,
    OFFLOAD,
    SsdMount,
    Task,
    TierConfig,
    TierStats,
)
from kvpool.store.wire.codes import ErrorCode, Tier

if TYPE_CHECKING:
    from kvpool.store.master.core_api import CoreApi

E = ErrorCode
SSD_BASE_ADDR = 0
"""Base address of every SSD segment: disk ranges are accounting, not memory (a DRAM segment
never starts at 0, so segment ids stay distinct)."""


class TierState:
    """The disk tier's tables and its shared actions."""

    def __init__(self, core: CoreApi, config: TierConfig | None = None) -> None:
        self.core = core
        self.config = config or TierConfig()
        self.mounts: dict[str, SsdMount] = {}
        """SSD segment id -> the node's disk tier."""
        self.on_disk = DiskKeys()
        self.under_way = TierTransfers()
        self.left = LeftFiles()
        """Files on disks the master lost, refused at registration once stale."""
        self.stats = TierStats()
        self._ids = itertools.count(1)
        self._rng = random.Random()

    # -- nodes -----------------------------------------------------------------------------

    def attach(self, client_id: str, endpoint: str, size: int,
               promote_after: int) -> tuple[ErrorCode, str]:
        """Mount (or keep) `client_id`'s disk tier of `size` bytes."""
        if type(promote_after) is not int or not 1 <= promote_after <= 1 << 20:
            return E.INVALID_PARAMS, ""
        code, segment_id = self.core.mount_segment(client_id, endpoint, SSD_BASE_ADDR, size,
                                                   Tier.SSD, 0)
        if code != E.OK:
            return code, ""
        seg = self.core.segments[segment_id]
        mount = self.mounts.get(segment_id)
        if mount is None or mount.segment is not seg:
            mount = self.mounts[segment_id] = SsdMount(seg, promote_after)
        mount.set_promote_after(promote_after)
        return E.OK, segment_id

    def mount_of(self, client_id: str, segment_id: str) -> SsdMount | None:
        mount = self.mounts.get(segment_id)
        return mount if mount is not None and mount.segment.client_id == client_id else None

    def next_tasks(self, client_id: str, segment_id: str) -> tuple[ErrorCode, list[Task]]:
        """Tasks due for the node (SEGMENT_NOT_FOUND: attach again)."""
        mount = self.mount_of(client_id, segment_id)
        if mount is None:
            return E.SEGMENT_NOT_FOUND, []
        self.core.touch_client(client_id)
        cfg = self.config
        return E.OK, mount.due(self.core.clock.now(), cfg.redeliver_s,
                               cfg.max_tasks_per_poll, cfg.max_task_bytes_per_poll)

    def new_gen(self) -> int:
        """A random generation for a new disk file."""
        return self._rng.getrandbits(64)

    def queue(self, mount: SsdMount, kind: int, key: str, obj: StoredObject | None,
               size: int, gen: int, dram: Replica | None = None,
               ssd: Replica | None = None) -> Task:
        checksum = obj.checksum if obj is not None else None
        task = Task(next(self._ids), kind, key, obj, size, checksum, gen, dram, ssd)
        mount.add(task)
        return task

    # -- offload (tier_offload.py) ----------------------------------------------------------

    def evicting(self, key: str) -> bool:
        """Whether an offload under way frees `key`'s DRAM when done."""
        return self.under_way.evicting(key)

    def disk_of(self, client_id: str) -> SsdMount | None:
        for mount in self.mounts.values():
            if mount.segment.client_id == client_id:
                return mount
        return None

    def drop_dram(self, obj: StoredObject) -> int:
        """Free every DRAM replica of an object that has a disk one (after its lease)."""
        core, freed = self.core, 0
        for r in [r for r in obj.replicas if r.segment.tier is Tier.DRAM]:
            core.objects.drop_replica(obj, r)
            freed += r.segment.allocator.rounded(r.size)
            core.space.free_after(r, obj.lease_until)
        core.objects.set_evictable(obj.key, False)
        self.on_disk.dram_dropped(obj.key)
        self.journal_put(obj)
        return freed

    def journal_put(self, obj: StoredObject) -> None:
        if self.core.journal is not None:
            self.core.journal.on_put(obj)

    # -- disk space --------------------------------------------------------------------

    def allocate_disk(self, mount: SsdMount, size: int) -> Replica | None:
        alloc = mount.segment.allocator
        offset = alloc.allocate(size)
        if offset is None:
            self.evict_disk(mount, max(alloc.rounded(size),
                                       int(self.core.config.eviction_ratio * alloc.capacity)))
            offset = alloc.allocate(size)
        return None if offset is None else Replica(mount.segment, offset, size)

    @staticmethod
    def free_disk(mount: SsdMount, size: int) -> Replica | None:
        offset = mount.segment.allocator.allocate(size)
        return None if offset is None else Replica(mount.segment, offset, size)

    def evict_disk(self, mount: SsdMount, num_bytes: int) -> int:
        """Drop least recently used disk replicas on `mount` of unleased, unpinned objects
        that no task is using, until `num_bytes` are freed; returns the bytes freed."""
        now, seg, freed = self.core.clock.now(), mount.segment, 0
        chosen = []
        loading, offloading = self.under_way.loading, self.under_way.offloading
        for key in self.on_disk.lru:
            if freed >= num_bytes:
                break
            obj = self.core.objects.get(key)
            if obj is None or obj.hard_pinned or obj.lease_until > now \
                    or key in loading or key in offloading:
                continue
            rep = next((r for r in obj.replicas if r.segment is seg), None)
            if rep is not None:
                chosen.append((obj, rep))
                freed += seg.allocator.rounded(rep.size)
        for obj, rep in chosen:
            self.drop_disk_replica(obj, rep)
        self.stats.disk_evicted_objects += len(chosen)
        self.stats.disk_evicted_bytes += freed
        return freed

    def drop_disk_replica(self, obj: StoredObject, rep: Replica) -> None:
        if len(obj.replicas) == 1:
            self.core.remove_object(obj, defer=False)  # on_remove queues the DELETE
            return
        self.core.objects.drop_replica(obj, rep)
        self.core.space.free(rep.segment, rep.offset)
        self._forget_disk(obj.key, rep.segment)
        if not any(r.segment.tier is Tier.SSD for r in obj.replicas):
            self.on_disk.untier(obj.key)  # back to a plain DRAM object (its copy stays)
            self.core.objects.set_evictable(obj.key, True)
        self.journal_put(obj)

    def _forget_disk(self, key: str, seg: Segment) -> None:
        gen = self.on_disk.forget_replica(key, seg.segment_id)
        mount = self.mounts.get(seg.segment_id)
        if gen is not None and mount is not None and mount.segment is seg:
            self.queue(mount, DELETE, key, None, 0, gen)

    # -- removal, segments, time ---------------------------------------------------------

    @property
    def watching(self) -> bool:
        """Whether the core must report removals (`on_remove`): a disk is mounted, or
        files of a lost one may come back."""
        return bool(self.mounts) or bool(self.left)

    def on_remove(self, obj: StoredObject) -> None:
        """`obj` is being removed (core.remove_object, before its ranges are freed)."""
        key = obj.key
        self.left.key_gone(key)
        offload = self.under_way.offloading.get(key)
        if offload is not None:  # the node may be reading the DRAM range: hold it
            self.under_way.untrack_offload(offload)
            offload.obj = None
            self.core.objects.extend_lease(obj, self.core.clock.now() + self.config.redeliver_s)
        load = self.under_way.drop_load(key)
        if load is not None:
            load.obj = None
        for r in obj.replicas:
            if r.segment.tier is Tier.SSD:
                self._forget_disk(key, r.segment)
        self.on_disk.removed(key)

    def after_segment_dropped(self, seg: Segment) -> None:
        """`seg` is gone (and objects left without a replica with it)."""
        mount = self.mounts.pop(seg.segment_id, None)
        for task in list(mount.tasks.values()) if mount is not None else []:
            self._leave(task)
            self._cancel(task, seg)
        for table in (self.under_way.offloading, self.under_way.loading):
            for task in [t for t in table.values() if t.dram and t.dram.segment is seg]:
                self._cancel(task, seg)
        on_disk = self.on_disk
        for key in [k for k in on_disk.tiered if self._disk_replicas(k) == 0]:
            if self.core.objects.get(key) is not None:  # its DRAM copy (a loaded one too,
                self.core.objects.set_evictable(key, True)  # untiered below) is plain now
            on_disk.untier(key)
        for key, gen in on_disk.forget_segment(seg.segment_id).items():
            self.left.left(key, gen)

    def _leave(self, task: Task) -> None:
        """A task of a lost disk: the file its node may still hold (a DELETE not run, an
        offload written but not reported) is remembered (LeftFiles)."""
        if task.kind == DELETE or (task.kind == OFFLOAD and task.obj is None):
            self.left.void(task.key, task.gen)
        elif task.kind == OFFLOAD:
            self.left.left(task.key, task.gen)

    def _disk_replicas(self, key: str) -> int:
        obj = self.core.objects.get(key)
        return 0 if obj is None else sum(r.segment.tier is Tier.SSD for r in obj.replicas)

    def _cancel(self, task: Task, dropped: Segment | None = None) -> None:
        """Forget a task whose disk or DRAM segment went away. A load's DRAM range is held
        for put_release_timeout_s: the node may still be writing it (on `dropped`, the
        segment being dropped, the hold goes into its quarantine, kept if the same memory
        is mounted again under the same fence)."""
        if task.kind == OFFLOAD:
            self.under_way.untrack_offload(task)
        else:
            self.under_way.end_load(task)
        for mount in self.mounts.values():
            mount.take(task.task_id)
        core = self.core
        if task.kind == LOAD and task.dram is not None:
            seg = task.dram.segment
            if seg is dropped or core.segments.get(seg.segment_id) is seg:
                core.space.release_at(core.clock.now() + core.config.put_release_timeout_s,
                                      seg, task.dram.offset)
        if task.kind == OFFLOAD and task.ssd is not None:
            core.space.free(task.ssd.segment, task.ssd.offset)
            disk = self.mounts.get(task.ssd.segment.segment_id)
            if disk is not None:  # runs after the offload on the node, if it still does it
                self.queue(disk, DELETE, task.key, None, 0, task.gen)

    def expire_transient(self) -> None:
        now = self.core.clock.now()
        for key in list(self.on_disk.transient):
            obj = self.core.objects.get(key)
            if obj is not None and obj.lease_until <= now:
                self.drop_dram(obj)

    def held_ranges(self) -> list[tuple[Segment, int, int]]:
        """(segment, offset, size) of ranges tasks hold on mounted segments (for the
        integrity check; a queued load of a removed object keeps the range of a DRAM
        segment dropped since, which is no longer the master's to account for)."""
        out = [(t.ssd.segment, t.ssd.offset, t.size)
               for t in self.under_way.offloading.values() if t.ssd is not None]
        out += [(t.dram.segment, t.dram.offset, t.size) for m in self.mounts.values()
                for t in m.tasks.values() if t.kind == LOAD and t.dram is not None]
        out += [(t.ssd.segment, t.ssd.offset, t.size) for m in self.mounts.values()
                for t in m.tasks.values() if t.kind == OFFLOAD and t.obj is None
                and t.ssd is not None]
        mounted = self.core.segments.get
        return [held for held in out if mounted(held[0].segment_id) is held[0]]

    def check_integrity(self) -> None:
        """AssertionError unless each table holds its own invariants and every mount is
        filed under its segment's id."""
        self.on_disk.check_integrity(self._disk_replicas)
        self.left.check_integrity()
        self.under_way.check_integrity(self.core.objects.get)
        for segment_id, mount in self.mounts.items():
            mount.check_integrity()
            assert mount.segment.segment_id == segment_id, f"mount {segment_id} misfiled"
