"""Reads of objects on disk (load, transient copies, promotion) and the registration of a
restarted node's files: the read side of tiering.py, as functions over the tier's state
(tier_state.py), which they change only through its tables' methods (tier_tables.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvpool.store.master.state import Replica, StoredObject
from kvpool.store.master.tier_tasks import DONE, FILE_BAD, LOAD, SsdMount, Task
from kvpool.store.wire.codes import ErrorCode, LookupResult, Tier
from kvpool.store.wire.validate import valid_key, valid_size

if TYPE_CHECKING:
    from kvpool.store.master.tier_state import TierState

E = ErrorCode
NOT_READY = LookupResult(E.REPLICA_IS_NOT_READY)


def on_lookup(t: TierState, obj: StoredObject) -> LookupResult | None:
    """A lookup of a key in `tiered`: None to answer as usual (a promoted DRAM copy
    exists), else the answer: REPLICA_IS_NOT_READY while a load runs, or the transient
    copy under a short lease (`transient_lease_s`, so that reads of more cold data than
    DRAM holds are not held up by leases). Reads are counted per load started and per
    hit of a transient copy, except the first hit after the load (the reader that
    asked for it, looking again), which gets the short lease even when the load promoted
    the copy."""
    key, cfg, on_disk = obj.key, t.config, t.on_disk
    on_disk.touch(key)
    has_dram = any(r.segment.tier is Tier.DRAM for r in obj.replicas)
    if has_dram and key not in on_disk.transient and key not in on_disk.fresh:
        return None
    until = t.core.clock.now() + cfg.transient_lease_s
    t.core.objects.extend_lease(obj, until)
    if not has_dram:
        if key not in t.under_way.loading and _start_load(t, obj):
            on_disk.count_read(key)
        return NOT_READY
    if not on_disk.seen_fresh(key) and on_disk.count_read(key) >= _promote_after(t, obj):
        _promote(t, obj)
        return None
    descs = tuple(r.desc() for r in obj.replicas)
    return LookupResult(E.OK, obj.size, descs, cfg.transient_lease_s, obj.checksum)

def _promote_after(t: TierState, obj: StoredObject) -> int:
    for r in obj.replicas:
        mount = t.mounts.get(r.segment.segment_id)
        if mount is not None:
            return mount.promote_after
    return 1

def _promote(t: TierState, obj: StoredObject) -> None:
    t.on_disk.promoted(obj.key)
    t.core.objects.set_evictable(obj.key, True)
    t.stats.promotions += 1
    t.journal_put(obj)

def _start_load(t: TierState, obj: StoredObject) -> bool:
    """Queue LOAD of `obj` into a fresh DRAM range; False when no DRAM is free now
    (eviction is under way: the client asks again)."""
    source = next((r for r in obj.replicas
                   if t.mounts.get(r.segment.segment_id) is not None), None)
    if source is None:
        return False
    mount = t.mounts[source.segment.segment_id]
    target = _allocate_dram(t, mount.segment.client_id, obj.size)
    if target is None:
        return False
    gen = t.on_disk.gens.get((source.segment.segment_id, obj.key), 0)
    t.under_way.start_load(t.queue(mount, LOAD, obj.key, obj, obj.size, gen, target, source))
    return True

def _allocate_dram(t: TierState, client_id: str, size: int) -> Replica | None:
    """A DRAM range for a loaded copy: the disk's own node first, then any segment."""
    core = t.core
    t.expire_transient()
    own = [s.segment_id for s in core.segment_list() if s.client_id == client_id]
    found = core.allocate(size, 1, own, core.clock.now())
    return found[0] if found else None

def load_done(t: TierState, task: Task, status: int) -> None:
    obj, dram, ssd = task.obj, task.dram, task.ssd
    assert dram is not None and ssd is not None
    t.under_way.end_load(task)
    live = t.core.segments.get(dram.segment.segment_id) is dram.segment
    valid = live and obj is not None and t.core.objects.get(task.key) is obj \
        and ssd in obj.replicas
    if not (status == DONE and valid):
        t.core.space.free(dram.segment, dram.offset)
        if status != DONE:
            t.stats.load_failures += 1
        if status == FILE_BAD and valid and obj is not None:
            t.drop_disk_replica(obj, ssd)  # the node found the file bad: gone
        return
    assert obj is not None
    t.core.objects.add_replica(obj, dram)
    t.stats.loads += 1
    promote = t.on_disk.reads.get(task.key, 0) >= _promote_after(t, obj)
    t.on_disk.loaded(task.key, transient=not promote)
    if promote:
        _promote(t, obj)


def register(t: TierState, client_id: str, segment_id: str, keys: Sequence[str],
             sizes: Sequence[int], checksums: Sequence[int],
             gens: Sequence[int]) -> list[ErrorCode]:
    """Objects found on a node's disk: OK (now known), OBJECT_ALREADY_EXISTS (another
    object holds the key: the file is stale), NO_AVAILABLE_HANDLE (no room),
    INVALID_PARAMS, SEGMENT_NOT_FOUND."""
    mount = t.mount_of(client_id, segment_id)
    if mount is None:
        return [E.SEGMENT_NOT_FOUND] * len(keys)
    if not len(keys) == len(sizes) == len(checksums) == len(gens):
        return [E.INVALID_PARAMS] * len(keys)
    out = [_register_one(t, mount, *item)
           for item in zip(keys, sizes, checksums, gens, strict=True)]
    t.stats.registered += out.count(E.OK)
    t.stats.register_refused += len(out) - out.count(E.OK)
    return out

def _register_one(t: TierState, mount: SsdMount, key: str, size: int, checksum: int,
                  gen: int) -> ErrorCode:
    core, seg = t.core, mount.segment
    if not (valid_key(key) and valid_size(size, core.config.max_object_bytes)
            and type(checksum) is int and 0 <= checksum < 1 << 64
            and type(gen) is int and 0 <= gen < 1 << 64):
        return E.INVALID_PARAMS
    if t.left.refuse(key, gen):  # removed or replaced while its node was gone
        return E.OBJECT_ALREADY_EXISTS
    obj = core.objects.get(key)
    if key in core.pending or (obj is not None and (obj.size != size
                                                    or obj.checksum != checksum)):
        return E.OBJECT_ALREADY_EXISTS
    if obj is not None and any(r.segment is seg for r in obj.replicas):
        known = t.on_disk.gens.get((seg.segment_id, key))
        if known is None:  # re-attached from the master's state directory: adopt the file
            t.on_disk.add(key, seg.segment_id, gen)
        return E.OK if known in (None, gen) else E.OBJECT_ALREADY_EXISTS
    offset = seg.allocator.allocate(size)
    if offset is None:
        return E.NO_AVAILABLE_HANDLE
    rep = Replica(seg, offset, size)
    if obj is None:
        obj = StoredObject(key, size, [rep], checksum=checksum)
        core.objects.insert(obj, evictable=False)  # only on disk: not DRAM's to evict
    else:
        core.objects.add_replica(obj, rep)
    t.on_disk.add(key, seg.segment_id, gen)
    t.journal_put(obj)
    return E.OK
