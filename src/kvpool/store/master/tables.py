"""The master's two tables, each the only writer of its state and the indexes that must agree
with it. Everything else reads them like mappings and changes them through these methods.

- `ObjectTable`: complete objects by key, each segment's `keys` index (objects with a replica
  there), and the eviction policy's order (objects with a DRAM copy that eviction may drop).
- `SegmentTable`: mounted segments by id, the subset that takes placements (DRAM, not
  draining; cached: puts ask for it on every allocation) and the DRAM capacity.

The pending puts (pending.py) and the deferred releases (space.py) are tables of their own.
"""

from __future__ import annotations

from collections.abc import Iterator, ValuesView
from typing import TYPE_CHECKING, overload

from kvpool.store.master.keyed import KeyedReads
from kvpool.store.master.pool_events import PoolEventSink, media_of, report_change
from kvpool.store.master.state import Replica, Segment, StoredObject
from kvpool.store.wire.codes import Tier

if TYPE_CHECKING:
    from kvpool.store.master.eviction import EvictionPolicy


class ObjectTable(KeyedReads[StoredObject]):
    def __init__(self, policy: EvictionPolicy) -> None:
        self._by_key: dict[str, StoredObject] = {}
        self.policy = policy
        """The eviction order (read it; the table tells it of every insert and removal)."""
        self.events: PoolEventSink | None = None
        """Told when a key gains or loses a medium (pool_events.py); None: nobody listens."""

    # -- reads (a mapping of key -> StoredObject) -----------------------------------------

    @overload
    def get(self, key: str) -> StoredObject | None: ...
    @overload
    def get(self, key: str, default: StoredObject) -> StoredObject: ...

    def get(self, key: str, default: StoredObject | None = None) -> StoredObject | None:
        return self._by_key.get(key, default)

    # -- actions ---------------------------------------------------------------------------

    def report_to(self, events: PoolEventSink) -> None:
        """Tell `events` of every change of a key's media from now on."""
        self.events = events

    def insert(self, obj: StoredObject, evictable: bool = True) -> None:
        """Store `obj` (its key must be free) and index its replicas; `evictable`: it
        enters the eviction order (an object only on disk does not)."""
        assert obj.key not in self._by_key, f"{obj.key!r} inserted twice"
        self._by_key[obj.key] = obj
        for r in obj.replicas:
            r.segment.keys.add(obj.key)
        if evictable:
            self.policy.on_insert(obj.key)
        if self.events is not None:
            report_change(self.events, obj.key, set(), media_of(obj.replicas))

    def insert_run(self, objs: list[StoredObject]) -> None:
        """insert() of each of `objs` (keys distinct and free, all evictable), the table
        and the segments' indexes updated once per batch where they can be."""
        new = {obj.key: obj for obj in objs}
        assert len(new) == len(objs) and self._by_key.keys().isdisjoint(new), \
            "a key inserted twice"
        self._by_key.update(new)
        on_insert, events = self.policy.on_insert, self.events
        for key, obj in new.items():
            for r in obj.replicas:
                r.segment.keys.add(key)
            on_insert(key)
            if events is not None:
                report_change(events, key, set(), media_of(obj.replicas))

    def remove(self, obj: StoredObject) -> None:
        """Forget `obj` and its index entries (its memory is the caller's to free)."""
        del self._by_key[obj.key]
        self.policy.on_remove(obj.key)
        for r in obj.replicas:
            r.segment.keys.discard(obj.key)
        if self.events is not None:
            report_change(self.events, obj.key, media_of(obj.replicas), set())

    def add_replica(self, obj: StoredObject, replica: Replica) -> None:
        before = media_of(obj.replicas) if self.events is not None else set()
        obj.replicas.append(replica)
        replica.segment.keys.add(obj.key)
        if self.events is not None and obj.key in self._by_key:
            report_change(self.events, obj.key, before, media_of(obj.replicas))

    def drop_replica(self, obj: StoredObject, replica: Replica) -> None:
        """Take one replica off `obj` (the object stays, even with none left: callers
        that may leave it empty remove it)."""
        before = media_of(obj.replicas) if self.events is not None else set()
        obj.replicas.remove(replica)
        replica.segment.keys.discard(obj.key)
        if self.events is not None and obj.key in self._by_key:
            report_change(self.events, obj.key, before, media_of(obj.replicas))

    def extend_lease(self, obj: StoredObject, until: float) -> None:
        """Hold `obj` (its ranges may not be freed or reused) until at least `until`: a lease
        only ever grows; one that already runs longer is left as it is. The only writer of
        `StoredObject.lease_until` (`obj` may be on its way out of the table: a removal that
        must wait for a reader extends it too)."""
        if obj.lease_until < until:
            obj.lease_until = until

    def set_evictable(self, key: str, evictable: bool) -> None:
        """Put an object into the eviction order (it has a DRAM copy again) or take it out."""
        if evictable:
            self.policy.on_insert(key)
        else:
            self.policy.on_remove(key)

    def drop_segment(self, seg: Segment) -> list[StoredObject]:
        """Drop every replica on `seg`; the objects left with none are removed and
        returned."""
        gone = []
        for key in list(seg.keys):
            obj = self._by_key[key]
            before = media_of(obj.replicas) if self.events is not None else set()
            obj.replicas = [r for r in obj.replicas if r.segment is not seg]
            if self.events is not None:
                report_change(self.events, key, before, media_of(obj.replicas))
            if not obj.replicas:
                del self._by_key[key]
                self.policy.on_remove(key)
                gone.append(obj)
        seg.keys.clear()
        return gone

    def check_integrity(self) -> None:
        """AssertionError unless every object is indexed on each of its replicas' segments."""
        for key, obj in self._by_key.items():
            assert obj.key == key, f"{key!r} holds the object of {obj.key!r}"
            assert obj.replicas, f"{key!r} has no replica"
            for r in obj.replicas:
                assert key in r.segment.keys, f"{key!r} missing from {r.segment.segment_id} keys"


class SegmentTable:
    def __init__(self) -> None:
        self._by_id: dict[str, Segment] = {}
        self._placeable: list[Segment] | None = None
        self.dram_capacity = 0
        """Bytes of the mounted DRAM segments (disks have their own accounts)."""

    # -- reads (a mapping of segment id -> Segment) ----------------------------------------

    def get(self, segment_id: str) -> Segment | None:
        return self._by_id.get(segment_id)

    def __getitem__(self, segment_id: str) -> Segment:
        return self._by_id[segment_id]

    def __contains__(self, segment_id: object) -> bool:
        return segment_id in self._by_id

    def __len__(self) -> int:
        return len(self._by_id)

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_id)

    def values(self) -> ValuesView[Segment]:
        return self._by_id.values()

    def items(self) -> Iterator[tuple[str, Segment]]:
        return iter(self._by_id.items())

    def placeable(self) -> list[Segment]:
        """The segments that take new placements: DRAM ones that are not draining."""
        if self._placeable is None:
            self._placeable = [s for s in self._by_id.values()
                               if s.tier is Tier.DRAM and not s.draining]
        return self._placeable

    def dram(self) -> list[Segment]:
        """Every DRAM segment, draining ones included (what capacity and the eviction
        watermark count)."""
        return [s for s in self._by_id.values() if s.tier is Tier.DRAM]

    # -- actions ---------------------------------------------------------------------------

    def add(self, seg: Segment) -> None:
        assert seg.segment_id not in self._by_id, f"{seg.segment_id} mounted twice"
        self._by_id[seg.segment_id] = seg
        self._placeable = None
        if seg.tier is Tier.DRAM:
            self.dram_capacity += seg.capacity

    def remove(self, seg: Segment) -> None:
        del self._by_id[seg.segment_id]
        self._placeable = None
        if seg.tier is Tier.DRAM:
            self.dram_capacity -= seg.capacity

    def set_draining(self, seg: Segment, draining: bool) -> None:
        seg.draining = draining
        self._placeable = None

    def check_integrity(self) -> None:
        assert self.dram_capacity == sum(s.capacity for s in self.dram()), "DRAM capacity"
        assert self._placeable is None or self._placeable == [
            s for s in self._by_id.values() if s.tier is Tier.DRAM and not s.draining], \
            "stale placement list"
        for sid, seg in self._by_id.items():
            assert seg.segment_id == sid, f"{sid} holds segment {seg.segment_id}"
