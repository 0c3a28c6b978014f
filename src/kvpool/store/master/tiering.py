"""The master's side of the disk (SSD) tier: what leaves DRAM for disk, what comes back.

Sans-I/O like the core it hooks into. A node with a disk tier mounts it as a segment of tier
SSD (`attach`); that segment's allocator is the master's account of the disk. Then:

- **Offload.** An eviction victim whose DRAM replica lives on a node with a disk tier is not
  dropped: the master reserves disk space and queues OFFLOAD; the object stays readable from
  DRAM meanwhile. On the node's report the object gets its SSD replica and its DRAM ranges
  are freed (after the read lease, if leased). Puts never wait for it: bytes in flight count
  toward the eviction target, and an allocation that finds nothing free right now fails.
  An object already on disk loses its DRAM copy at once (no copy needed).
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
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvpool.store.master.state import Replica, Segment, StoredObject
from kvpool.store.master.tier_tasks import (
    DELETE,
    DONE,
    FILE_BAD,
    LOAD,
    OFFLOAD,
    SsdMount,
    Task,
    TierStats,
)
from kvpool.store.wire.codes import ErrorCode, LookupResult, Tier
from kvpool.store.wire.validate import valid_key, valid_size

if TYPE_CHECKING:
    from kvpool.store.master.core import MasterCore

E = ErrorCode
SSD_BASE_ADDR = 0
"""Base address of every SSD segment: disk ranges are accounting, not memory (a DRAM segment
never starts at 0, so segment ids stay distinct)."""
NOT_READY = LookupResult(E.REPLICA_IS_NOT_READY)


@dataclass(frozen=True)
class TierConfig:
    disk_high_watermark: float = 0.95
    """Disk eviction starts above this share of a disk tier's capacity..."""
    disk_low_watermark: float = 0.85
    """...and frees down to this share."""
    redeliver_s: float = 10.0
    """A task handed out and not reported for this long is handed out again."""
    max_tasks_per_poll: int = 64
    transient_lease_s: float = 2.0
    """Read lease of a lookup that finds a transient (loaded, not promoted) copy, or a load
    under way; the copy is freed when it ends."""


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
        self.offloading_bytes = 0
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
        return E.OK, mount.due(self.core.clock.now(), self.config.redeliver_s,
                               self.config.max_tasks_per_poll)

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
                self._offload_done(task, status == DONE)
            elif task is not None and task.kind == LOAD:
                self._load_done(task, status)
        return E.OK

    def _queue(self, mount: SsdMount, kind: int, key: str, obj: StoredObject | None,
               size: int, gen: int, dram: Replica | None = None,
               ssd: Replica | None = None) -> Task:
        checksum = obj.checksum if obj is not None else None
        task = Task(next(self._ids), kind, key, obj, size, checksum, gen, dram, ssd)
        mount.tasks[task.task_id] = task
        return task

    # -- offload ---------------------------------------------------------------------------

    def take_victims(self, victims: list[StoredObject]) -> tuple[list[StoredObject], int]:
        """Handle DRAM eviction victims: (the ones to drop as before, DRAM bytes freed
        here). Objects on disk lose their DRAM copy; others are offloaded where a disk
        tier has room."""
        drop, freed = [], 0
        for obj in victims:
            if obj.key in self.tiered:
                freed += self._drop_dram(obj)
                self.stats.dram_dropped += 1
            elif obj.key in self.failed or not self._start_offload(obj):
                self.failed.discard(obj.key)
                drop.append(obj)
        return drop, freed

    def _start_offload(self, obj: StoredObject) -> bool:
        for r in obj.replicas:
            mount = self._disk_of(r.segment.client_id)
            if mount is None:
                continue
            ssd = self._allocate_disk(mount, obj.size)
            if ssd is None:
                return False
            gen = self._rng.getrandbits(64)
            self.offloading[obj.key] = self._queue(mount, OFFLOAD, obj.key, obj, obj.size,
                                                   gen, r, ssd)
            self.offloading_bytes += obj.size
            return True
        return False

    def _disk_of(self, client_id: str) -> SsdMount | None:
        for mount in self.mounts.values():
            if mount.segment.client_id == client_id:
                return mount
        return None

    def _offload_done(self, task: Task, ok: bool) -> None:
        obj, ssd = task.obj, task.ssd
        assert ssd is not None
        if self.offloading.get(task.key) is task:
            del self.offloading[task.key]
            self.offloading_bytes -= task.size
        live = self.core.segments.get(ssd.segment.segment_id) is ssd.segment
        valid = ok and live and obj is not None and self.core.objects.get(task.key) is obj \
            and task.dram in obj.replicas
        if not valid:
            self.core._free(ssd.segment, ssd.offset)
            if ok and live:
                self._queue(self.mounts[ssd.segment.segment_id], DELETE, task.key, None, 0,
                            task.gen)
            if not ok and obj is not None:
                self.failed.add(task.key)
                self.stats.offload_failures += 1
            return
        assert obj is not None
        obj.replicas.append(ssd)
        ssd.segment.keys.add(task.key)
        self._add_tiered(task.key, ssd.segment, task.gen)
        self._drop_dram(obj)
        self.stats.offloads += 1

    def _add_tiered(self, key: str, seg: Segment, gen: int) -> None:
        self.gens[(seg.segment_id, key)] = gen
        self.tiered.add(key)
        self.lru[key] = None
        self.lru.move_to_end(key)
        self.reads.pop(key, None)

    def _drop_dram(self, obj: StoredObject) -> int:
        """Free every DRAM replica of an object that has a disk one (after its lease)."""
        core, freed = self.core, 0
        leased = obj.lease_until > core.clock.now()
        for r in [r for r in obj.replicas if r.segment.tier is Tier.DRAM]:
            obj.replicas.remove(r)
            r.segment.keys.discard(obj.key)
            freed += r.segment.allocator.rounded(r.size)
            if leased:
                core._deferred.append((obj.lease_until, r.segment, r.offset))
            else:
                core._free(r.segment, r.offset)
        core.policy.on_remove(obj.key)
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
        obj.replicas.remove(rep)
        rep.segment.keys.discard(obj.key)
        self.core._free(rep.segment, rep.offset)
        self._forget_disk(obj.key, rep.segment)
        if not any(r.segment.tier is Tier.SSD for r in obj.replicas):
            self._untier(obj.key)  # back to a plain DRAM object (a transient copy stays)
            self.core.policy.on_insert(obj.key)
            self.transient.discard(obj.key)
        self._journal(obj)

    def _forget_disk(self, key: str, seg: Segment) -> None:
        gen = self.gens.pop((seg.segment_id, key), None)
        mount = self.mounts.get(seg.segment_id)
        if gen is not None and mount is not None and mount.segment is seg:
            self._queue(mount, DELETE, key, None, 0, gen)

    def _untier(self, key: str) -> None:
        self.tiered.discard(key)
        self.lru.pop(key, None)
        self.reads.pop(key, None)

    # -- reads and promotion -------------------------------------------------------------

    def on_lookup(self, obj: StoredObject) -> LookupResult | None:
        """A lookup of a key in `tiered`: None to answer as usual (a promoted DRAM copy
        exists), else the answer: REPLICA_IS_NOT_READY while a load runs, or the transient
        copy under a short lease (`transient_lease_s`, so that reads of more cold data than
        DRAM holds are not held up by leases). Reads are counted per load started and per
        hit of a transient copy, except the first hit after the load (the reader that
        asked for it, looking again)."""
        key, cfg = obj.key, self.config
        self.lru.move_to_end(key)
        has_dram = any(r.segment.tier is Tier.DRAM for r in obj.replicas)
        if has_dram and key not in self.transient:
            return None
        until = self.core.clock.now() + cfg.transient_lease_s
        obj.lease_until = max(obj.lease_until, until)
        if not has_dram:
            if key not in self.loading:
                self._count_read(key)
                self._start_load(obj)
            return NOT_READY
        if key in self.fresh:
            self.fresh.discard(key)
        elif self._count_read(key) >= self._promote_after(obj):
            self._promote(obj)
            return None
        descs = tuple(r.desc() for r in obj.replicas)
        return LookupResult(E.OK, obj.size, descs, cfg.transient_lease_s, obj.checksum)

    def _count_read(self, key: str) -> int:
        reads = self.reads[key] = self.reads.get(key, 0) + 1
        return reads

    def _promote_after(self, obj: StoredObject) -> int:
        for r in obj.replicas:
            mount = self.mounts.get(r.segment.segment_id)
            if mount is not None:
                return mount.promote_after
        return 1

    def _promote(self, obj: StoredObject) -> None:
        self.transient.discard(obj.key)
        self.fresh.discard(obj.key)
        self.reads.pop(obj.key, None)
        self.core.policy.on_insert(obj.key)
        self.stats.promotions += 1
        self._journal(obj)

    def _start_load(self, obj: StoredObject) -> None:
        source = next((r for r in obj.replicas
                       if self.mounts.get(r.segment.segment_id) is not None), None)
        if source is None:
            return
        mount = self.mounts[source.segment.segment_id]
        target = self._allocate_dram(mount.segment.client_id, obj.size)
        if target is None:
            return  # nothing free now: eviction is under way, the client asks again
        gen = self.gens.get((source.segment.segment_id, obj.key), 0)
        self.loading[obj.key] = self._queue(mount, LOAD, obj.key, obj, obj.size, gen,
                                            target, source)

    def _allocate_dram(self, client_id: str, size: int) -> Replica | None:
        """A DRAM range for a loaded copy: the disk's own node first, then any segment."""
        from kvpool.store.master import evict as master_evict
        core = self.core
        self._expire_transient()
        own = [s.segment_id for s in core.segment_list() if s.client_id == client_id]
        found = core._try_allocate(size, 1, own)
        if found is None and master_evict.evict_for_allocation(core, size, 1,
                                                               core.clock.now()):
            found = core._try_allocate(size, 1, own)
        return found[0] if found else None

    def _load_done(self, task: Task, status: int) -> None:
        obj, dram, ssd = task.obj, task.dram, task.ssd
        assert dram is not None and ssd is not None
        if self.loading.get(task.key) is task:
            del self.loading[task.key]
        live = self.core.segments.get(dram.segment.segment_id) is dram.segment
        valid = live and obj is not None and self.core.objects.get(task.key) is obj \
            and ssd in obj.replicas
        if not (status == DONE and valid):
            self.core._free(dram.segment, dram.offset)
            if status != DONE:
                self.stats.load_failures += 1
            if status == FILE_BAD and valid and obj is not None:
                self._drop_disk_replica(obj, ssd)  # the node found the file bad: gone
            return
        assert obj is not None
        obj.replicas.append(dram)
        dram.segment.keys.add(task.key)
        self.stats.loads += 1
        if self.reads.get(task.key, 0) >= self._promote_after(obj):
            self._promote(obj)
        else:
            self.transient.add(task.key)
            self.fresh.add(task.key)

    # -- removal, segments, time ---------------------------------------------------------

    def on_remove(self, obj: StoredObject) -> None:
        """`obj` is being removed (core._remove_object, before its ranges are freed)."""
        key = obj.key
        offload = self.offloading.pop(key, None)
        if offload is not None:  # the node may be reading the DRAM range: hold it
            offload.obj = None
            self.offloading_bytes -= offload.size
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
                self.core.policy.on_insert(key)
            self.transient.discard(key)
        for gk in [gk for gk in self.gens if gk[0] == seg.segment_id]:
            del self.gens[gk]

    def _disk_replicas(self, key: str) -> int:
        obj = self.core.objects.get(key)
        return 0 if obj is None else sum(r.segment.tier is Tier.SSD for r in obj.replicas)

    def _cancel(self, task: Task) -> None:
        """Forget a task whose disk or DRAM segment went away. A load's DRAM range is held
        for put_release_timeout_s: the node may still be writing it."""
        table = self.offloading if task.kind == OFFLOAD else self.loading
        if table.get(task.key) is task:
            del table[task.key]
            if task.kind == OFFLOAD:
                self.offloading_bytes -= task.size
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

    def tick(self) -> None:
        """Free transient copies whose lease ended; evict disks above their watermark."""
        self._expire_transient()
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
        for key in self.transient:
            assert key in self.tiered, f"transient {key!r} is not on disk"
        for key, task in self.offloading.items():
            assert task.obj is core.objects.get(key), f"offload of {key!r} lost its object"
        assert self.offloading_bytes == sum(t.size for t in self.offloading.values())

    # -- registration after a node restart --------------------------------------------------

    def register(self, client_id: str, segment_id: str, keys: Sequence[str],
                 sizes: Sequence[int], checksums: Sequence[int],
                 gens: Sequence[int]) -> list[ErrorCode]:
        """Objects found on a node's disk: OK (now known), OBJECT_ALREADY_EXISTS (another
        object holds the key: the file is stale), NO_AVAILABLE_HANDLE (no room),
        INVALID_PARAMS, SEGMENT_NOT_FOUND."""
        mount = self._mount_of(client_id, segment_id)
        if mount is None:
            return [E.SEGMENT_NOT_FOUND] * len(keys)
        if not len(keys) == len(sizes) == len(checksums) == len(gens):
            return [E.INVALID_PARAMS] * len(keys)
        out = [self._register_one(mount, *item)
               for item in zip(keys, sizes, checksums, gens, strict=True)]
        self.stats.registered += out.count(E.OK)
        self.stats.register_refused += len(out) - out.count(E.OK)
        return out

    def _register_one(self, mount: SsdMount, key: str, size: int, checksum: int,
                      gen: int) -> ErrorCode:
        core, seg = self.core, mount.segment
        if not (valid_key(key) and valid_size(size, core.config.max_object_bytes)
                and type(checksum) is int and 0 <= checksum < 1 << 64
                and type(gen) is int and 0 <= gen < 1 << 64):
            return E.INVALID_PARAMS
        obj = core.objects.get(key)
        if key in core.pending or (obj is not None and (obj.size != size
                                                        or obj.checksum != checksum)):
            return E.OBJECT_ALREADY_EXISTS
        if obj is not None and any(r.segment is seg for r in obj.replicas):
            return E.OK if self.gens.get((seg.segment_id, key)) == gen \
                else E.OBJECT_ALREADY_EXISTS
        offset = seg.allocator.allocate(size)
        if offset is None:
            return E.NO_AVAILABLE_HANDLE
        rep = Replica(seg, offset, size)
        if obj is None:
            obj = core.objects[key] = StoredObject(key, size, [rep], checksum=checksum)
        else:
            obj.replicas.append(rep)
        seg.keys.add(key)
        self._add_tiered(key, seg, gen)
        self._journal(obj)
        return E.OK
