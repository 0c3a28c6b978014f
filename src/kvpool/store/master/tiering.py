"""The master's side of the disk (SSD) tier: what leaves DRAM for disk, what comes back.

Sans-I/O like the core it hooks into. A node with a disk tier mounts it as a segment of tier
SSD (`attach`); that segment's allocator is the master's account of the disk. Then:

- **Offload.** An eviction victim whose DRAM replica lives on a node with a disk tier is not
  dropped: the master reserves disk space and queues OFFLOAD; the object stays readable from
  DRAM meanwhile. On the node's report the object gets its SSD replica and its DRAM ranges
  are freed (after the read lease, if leased). Puts never wait for it: bytes in flight count
  toward the eviction target, and an allocation that finds nothing free right now fails.
  An object already on disk loses its DRAM copy at once (no copy needed); so that this is
  the common case, the coldest `clean_share` of DRAM is copied ahead of eviction
  (tier_offload.py).
- **Load.** A lookup of a disk-only object answers REPLICA_IS_NOT_READY while a DRAM range is
  reserved (placement as for a put, the disk's own node first) and LOAD is queued; the
  client looks again shortly. The loaded copy is transient (freed when the read lease ends)
  until the object has been read `promote_after` times since it went to disk: then it is a
  normal DRAM replica again (promotion), evictable by the DRAM policy.
- **Disk eviction.** Above `disk_high_watermark` of a disk's capacity (or when an offload
  finds no room), the least recently used disk replicas of unleased objects are dropped;
  an object whose only replica that was is removed. Every dropped disk replica queues DELETE.
- **Restart.** A node scans its files and registers them (`register`): new keys become
  disk-only objects, existing objects with the same size and checksum gain the replica,
  anything else is refused (the node deletes the file).
"""

from __future__ import annotations

import itertools
import random
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvpool.store.master import tier_offload, tier_reads
from kvpool.store.master.state import Replica, Segment, StoredObject
from kvpool.store.master.tier_tasks import (
    DELETE,
    DONE,
    LOAD,
    OFFLOAD,
    SsdMount,
    Task,
    TierConfig,
    TierStats,
)
from kvpool.store.wire.codes import ErrorCode, LookupResult, Tier

if TYPE_CHECKING:
    from kvpool.store.master.core import MasterCore

E = ErrorCode
SSD_BASE_ADDR = 0
"""Base address of every SSD segment: disk ranges are accounting, not memory (a DRAM segment
never starts at 0, so segment ids stay distinct)."""


class Tiering:
    def __init__(self, core: MasterCore, config: TierConfig | None = None) -> None:
        self.core = core
        self.config = config or TierConfig()
        self.mounts: dict[str, SsdMount] = {}
        """SSD segment id -> the node's disk tier."""
        self.tiered: set[str] = set()
        """Keys with a disk replica (the lookup's one-set-probe test)."""
        self.gens: dict[tuple[str, str], int] = {}
        """(SSD segment id, key) -> generation of the file that holds the replica."""
        self.lru: OrderedDict[str, None] = OrderedDict()
        self.offloading: dict[str, Task] = {}
        """Offloads under way: evictions and copies ahead of eviction (Task.evict)."""
        self.offloading_bytes = 0
        """Bytes of the evicting offloads under way (they free DRAM when done)."""
        self.num_cleaning = 0
        """Copies ahead of eviction under way."""
        self.clean_due = 0.0
        """Clock time before which the copy-ahead walk is not run again (outside ticks)."""
        self.clean_wanted = True
        """Eviction took from the clean share, or the last walk stopped at the in-flight
        cap: walk again after the next eviction round or report (ticks always walk)."""
        self.loading: dict[str, Task] = {}
        self.reads: dict[str, int] = {}
        """Reads of an object since it went to disk (reset by promotion)."""
        self.transient: set[str] = set()
        """Keys whose DRAM copy is a load not promoted (freed when its lease ends)."""
        self.fresh: set[str] = set()
        """Transient copies not looked up since their load completed."""
        self.failed: set[str] = set()
        """Keys whose offload failed: the next eviction drops them."""
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
        mount.promote_after = promote_after
        return E.OK, segment_id

    def _mount_of(self, client_id: str, segment_id: str) -> SsdMount | None:
        mount = self.mounts.get(segment_id)
        return mount if mount is not None and mount.segment.client_id == client_id else None

    def next_tasks(self, client_id: str, segment_id: str) -> tuple[ErrorCode, list[Task]]:
        """Tasks due for the node (SEGMENT_NOT_FOUND: attach again)."""
        mount = self._mount_of(client_id, segment_id)
        if mount is None:
            return E.SEGMENT_NOT_FOUND, []
        self.core._touch_client(client_id)
        cfg = self.config
        return E.OK, mount.due(self.core.clock.now(), cfg.redeliver_s,
                               cfg.max_tasks_per_poll, cfg.max_task_bytes_per_poll)

    def report(self, client_id: str, segment_id: str,
               outcomes: Sequence[tuple[int, int]]) -> ErrorCode:
        """Outcomes of tasks: (task_id, DONE | FAILED | FILE_BAD); unknown ids (reported
        twice, or cancelled) are ignored."""
        mount = self._mount_of(client_id, segment_id)
        if mount is None:
            return E.SEGMENT_NOT_FOUND
        for task_id, status in outcomes:
            task = mount.tasks.pop(task_id, None)
            if task is not None and task.kind == OFFLOAD:
                tier_offload.offload_done(self, task, status == DONE)
            elif task is not None and task.kind == LOAD:
                tier_reads.load_done(self, task, status)
        if outcomes:
            self.clean_if_wanted()
        return E.OK

    def _queue(self, mount: SsdMount, kind: int, key: str, obj: StoredObject | None,
               size: int, gen: int, dram: Replica | None = None,
               ssd: Replica | None = None) -> Task:
        checksum = obj.checksum if obj is not None else None
        task = Task(next(self._ids), kind, key, obj, size, checksum, gen, dram, ssd)
        mount.tasks[task.task_id] = task
        return task

    # -- offload (tier_offload.py) ----------------------------------------------------------

    def take_victims(self, victims: list[StoredObject]) -> tuple[list[StoredObject], int]:
        """See tier_offload.take_victims."""
        return tier_offload.take_victims(self, victims)

    def clean_if_wanted(self) -> None:
        """After an eviction round or a report: when eviction took from the clean share (or
        the last walk stopped at its cap), copy the next objects ahead (rate-limited)."""
        if self.clean_wanted and self.core.clock.now() >= self.clean_due:
            tier_offload.clean_ahead(self)

    def evicting(self, key: str) -> bool:
        """Whether an offload under way frees `key`'s DRAM when done."""
        task = self.offloading.get(key)
        return task is not None and task.evict

    def _untrack_offload(self, task: Task) -> None:
        """Forget `task` as an offload under way (if it still is)."""
        if self.offloading.get(task.key) is task:
            del self.offloading[task.key]
            if task.evict:
                self.offloading_bytes -= task.size
            else:
                self.num_cleaning -= 1

    def _disk_of(self, client_id: str) -> SsdMount | None:
        for mount in self.mounts.values():
            if mount.segment.client_id == client_id:
                return mount
        return None

    def _add_tiered(self, key: str, seg: Segment, gen: int) -> None:
        self.gens[(seg.segment_id, key)] = gen
        self.tiered.add(key)
        self.lru[key] = None
        self.lru.move_to_end(key)
        self.reads.pop(key, None)

    def _drop_dram(self, obj: StoredObject) -> int:
        """Free every DRAM replica of an object that has a disk one (after its lease)."""
        core, freed = self.core, 0
        for r in [r for r in obj.replicas if r.segment.tier is Tier.DRAM]:
            core.objects.drop_replica(obj, r)
            freed += r.segment.allocator.rounded(r.size)
            core.free_after(r, obj.lease_until)
        core.objects.set_evictable(obj.key, False)
        self.transient.discard(obj.key)
        self.fresh.discard(obj.key)
        self._journal(obj)
        return freed

    def _journal(self, obj: StoredObject) -> None:
        if self.core.journal is not None:
            self.core.journal.on_put(obj)

    # -- disk space --------------------------------------------------------------------

    def _allocate_disk(self, mount: SsdMount, size: int) -> Replica | None:
        alloc = mount.segment.allocator
        offset = alloc.allocate(size)
        if offset is None:
            self.evict_disk(mount, max(alloc.rounded(size),
                                       int(self.core.config.eviction_ratio * alloc.capacity)))
            offset = alloc.allocate(size)
        return None if offset is None else Replica(mount.segment, offset, size)

    @staticmethod
    def _free_disk(mount: SsdMount, size: int) -> Replica | None:
        offset = mount.segment.allocator.allocate(size)
        return None if offset is None else Replica(mount.segment, offset, size)

    def evict_disk(self, mount: SsdMount, num_bytes: int) -> int:
        """Drop least recently used disk replicas on `mount` of unleased, unpinned objects
        that no task is using, until `num_bytes` are freed; returns the bytes freed."""
        now, seg, freed = self.core.clock.now(), mount.segment, 0
        chosen = []
        for key in self.lru:
            if freed >= num_bytes:
                break
            obj = self.core.objects.get(key)
            if obj is None or obj.hard_pinned or obj.lease_until > now \
                    or key in self.loading or key in self.offloading:
                continue
            rep = next((r for r in obj.replicas if r.segment is seg), None)
            if rep is not None:
                chosen.append((obj, rep))
                freed += seg.allocator.rounded(rep.size)
        for obj, rep in chosen:
            self._drop_disk_replica(obj, rep)
        self.stats.disk_evicted_objects += len(chosen)
        self.stats.disk_evicted_bytes += freed
        return freed

    def _drop_disk_replica(self, obj: StoredObject, rep: Replica) -> None:
        if len(obj.replicas) == 1:
            self.core._remove_object(obj, defer=False)  # on_remove queues the DELETE
            return
        self.core.objects.drop_replica(obj, rep)
        self.core._free(rep.segment, rep.offset)
        self._forget_disk(obj.key, rep.segment)
        if not any(r.segment.tier is Tier.SSD for r in obj.replicas):
            self._untier(obj.key)  # back to a plain DRAM object (a transient copy stays)
            self.core.objects.set_evictable(obj.key, True)
            self.transient.discard(obj.key)
        self._journal(obj)

    def _forget_disk(self, key: str, seg: Segment) -> None:
        gen = self.gens.pop((seg.segment_id, key), None)
        mount = self.mounts.get(seg.segment_id)
        if gen is not None and mount is not None and mount.segment is seg:
            self._queue(mount, DELETE, key, None, 0, gen)

    def _untier(self, key: str) -> None:
        self.tiered.discard(key)
        self.fresh.discard(key)
        self.lru.pop(key, None)
        self.reads.pop(key, None)

    # -- reads (tier_reads.py) --------------------------------------------------------------

    def on_lookup(self, obj: StoredObject) -> LookupResult | None:
        """See tier_reads.on_lookup."""
        return tier_reads.on_lookup(self, obj)

    def register(self, client_id: str, segment_id: str, keys: Sequence[str],
                 sizes: Sequence[int], checksums: Sequence[int],
                 gens: Sequence[int]) -> list[ErrorCode]:
        """See tier_reads.register."""
        return tier_reads.register(self, client_id, segment_id, keys, sizes, checksums, gens)

    # -- removal, segments, time ---------------------------------------------------------

    def on_remove(self, obj: StoredObject) -> None:
        """`obj` is being removed (core._remove_object, before its ranges are freed)."""
        key = obj.key
        offload = self.offloading.get(key)
        if offload is not None:  # the node may be reading the DRAM range: hold it
            self._untrack_offload(offload)
            offload.obj = None
            obj.lease_until = max(obj.lease_until,
                                  self.core.clock.now() + self.config.redeliver_s)
        load = self.loading.pop(key, None)
        if load is not None:
            load.obj = None
        for r in obj.replicas:
            if r.segment.tier is Tier.SSD:
                self._forget_disk(key, r.segment)
        self._untier(key)
        self.transient.discard(key)
        self.fresh.discard(key)
        self.failed.discard(key)

    def after_segment_dropped(self, seg: Segment) -> None:
        """`seg` is gone (and objects left without a replica with it)."""
        mount = self.mounts.pop(seg.segment_id, None)
        for task in list(mount.tasks.values()) if mount is not None else []:
            self._cancel(task)
        for table in (self.offloading, self.loading):
            for task in [t for t in table.values() if t.dram and t.dram.segment is seg]:
                self._cancel(task)
        for key in [k for k in self.tiered if self._disk_replicas(k) == 0]:
            obj = self.core.objects.get(key)
            self._untier(key)
            if obj is not None and key not in self.transient:
                self.core.objects.set_evictable(key, True)
            self.transient.discard(key)
        for gk in [gk for gk in self.gens if gk[0] == seg.segment_id]:
            del self.gens[gk]

    def _disk_replicas(self, key: str) -> int:
        obj = self.core.objects.get(key)
        return 0 if obj is None else sum(r.segment.tier is Tier.SSD for r in obj.replicas)

    def _cancel(self, task: Task) -> None:
        """Forget a task whose disk or DRAM segment went away. A load's DRAM range is held
        for put_release_timeout_s: the node may still be writing it."""
        if task.kind == OFFLOAD:
            self._untrack_offload(task)
        elif self.loading.get(task.key) is task:
            del self.loading[task.key]
        for mount in self.mounts.values():
            mount.tasks.pop(task.task_id, None)
        core = self.core
        if task.kind == LOAD and task.dram is not None:
            seg = task.dram.segment
            if core.segments.get(seg.segment_id) is seg:
                core._deferred.append((core.clock.now() + core.config.put_release_timeout_s,
                                       seg, task.dram.offset))
        if task.kind == OFFLOAD and task.ssd is not None:
            core._free(task.ssd.segment, task.ssd.offset)
            disk = self.mounts.get(task.ssd.segment.segment_id)
            if disk is not None:  # runs after the offload on the node, if it still does it
                self._queue(disk, DELETE, task.key, None, 0, task.gen)

    def tick(self) -> None:
        """Free transient copies whose lease ended; evict disks above their watermark;
        copy the cold end of DRAM ahead of eviction."""
        self._expire_transient()
        tier_offload.clean_ahead(self)
        cfg = self.config
        for mount in list(self.mounts.values()):
            alloc = mount.segment.allocator
            if alloc.used_bytes > cfg.disk_high_watermark * alloc.capacity:
                self.evict_disk(mount, alloc.used_bytes
                                - int(cfg.disk_low_watermark * alloc.capacity))

    def _expire_transient(self) -> None:
        now = self.core.clock.now()
        for key in list(self.transient):
            obj = self.core.objects.get(key)
            if obj is not None and obj.lease_until <= now:
                self._drop_dram(obj)

    def held_ranges(self) -> list[tuple[Segment, int, int]]:
        """(segment, offset, size) of ranges tasks hold (for the integrity check)."""
        out = [(t.ssd.segment, t.ssd.offset, t.size) for t in self.offloading.values()
               if t.ssd is not None]
        out += [(t.dram.segment, t.dram.offset, t.size) for m in self.mounts.values()
                for t in m.tasks.values() if t.kind == LOAD and t.dram is not None]
        out += [(t.ssd.segment, t.ssd.offset, t.size) for m in self.mounts.values()
                for t in m.tasks.values() if t.kind == OFFLOAD and t.obj is None
                and t.ssd is not None]
        return out

    def check_integrity(self) -> None:
        core = self.core
        for key in self.tiered:
            assert self._disk_replicas(key) > 0, f"tiered {key!r} has no disk replica"
        for key in self.transient | self.fresh:
            assert key in self.tiered, f"transient {key!r} is not on disk"
        for key, task in self.offloading.items():
            assert task.obj is core.objects.get(key), f"offload of {key!r} lost its object"
        assert self.offloading_bytes == sum(t.size for t in self.offloading.values()
                                            if t.evict)
        assert self.num_cleaning == sum(not t.evict for t in self.offloading.values())
