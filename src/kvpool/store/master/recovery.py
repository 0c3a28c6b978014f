"""A restarted master's recovered segments, waiting for their nodes to mount again, and
their objects: put back into the live tables when the same memory returns (same segment id,
client id, endpoint, base address and size), dropped when it does not within the grace."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvpool.log import get_logger
from kvpool.store.master.records import DurableState, ObjRec
from kvpool.store.master.state import Replica, Segment, StoredObject

if TYPE_CHECKING:
    from kvpool.store.master.core_api import CoreApi

log = get_logger("store.persist")


class Recovery:
    """Recovered segments waiting for their nodes, and their objects."""

    def __init__(self, state: DurableState, deadline: float) -> None:
        self.segments = dict(state.segments)
        self.deadline = deadline
        self._by_segment: dict[str, dict[str, ObjRec]] = {sid: {} for sid in self.segments}
        for obj in state.objects.values():
            for segment_id, _ in obj.replicas:
                self._by_segment[segment_id][obj.key] = obj
        self._attached: dict[str, StoredObject] = {}
        """Objects this recovery put back (later replicas join only those)."""

    @property
    def done(self) -> bool:
        return not self.segments

    def matches(self, seg: Segment) -> bool:
        rec = self.segments.get(seg.segment_id)
        return rec is not None and (rec.client_id, rec.endpoint, rec.base_addr, rec.size) \
            == (seg.client_id, seg.endpoint, seg.base_addr, seg.capacity)

    def give_up(self, segment_id: str) -> bool:
        self._by_segment.pop(segment_id, None)
        return self.segments.pop(segment_id, None) is not None

    def reattach(self, core: CoreApi, seg: Segment) -> tuple[list[str], list[StoredObject]]:
        """Put back the objects of a recovered segment its node mounted again. Returns the
        keys to record as removed (their recovered record would otherwise still place them
        here) and the objects to record again (they came back without this replica)."""
        if not self.matches(seg):
            return [], []
        del self.segments[seg.segment_id]
        dropped: list[str] = []
        changed: list[StoredObject] = []
        attached = 0
        recs = list(self._by_segment.pop(seg.segment_id, {}).values())
        clashing = _clashing(recs, seg.segment_id)
        for rec in recs:
            offset = next(o for s, o in rec.replicas if s == seg.segment_id)
            obj = core.objects.get(rec.key)
            ours = self._attached.get(rec.key)
            if obj is not None and ours is not obj:
                continue  # put again since: its own record comes later in the log
            if obj is None and (ours is not None or rec.key in core.pending):
                # back elsewhere and gone since (its segment left), or a put of the same
                # key is in flight (the old value is gone)
                dropped.append(rec.key)
            elif rec.key not in clashing and seg.allocator.reserve(offset, rec.size):
                self._attach(core, seg, rec, offset, obj)
                attached += 1
            elif obj is None:
                dropped.append(rec.key)
            else:
                changed.append(obj)
        log.info("segment %s mounted again: %d objects back", seg.segment_id, attached)
        return dropped, changed

    def _attach(self, core: CoreApi, seg: Segment, rec: ObjRec, offset: int,
                obj: StoredObject | None) -> None:
        replica = Replica(seg, offset, rec.size)
        if obj is None:
            obj = StoredObject(rec.key, rec.size, [replica], 0.0, rec.hard_pinned, 0.0,
                               rec.checksum)
            core.objects.insert(obj)
            self._attached[rec.key] = obj
        else:
            core.objects.add_replica(obj, replica)

    def forget(self, key: str) -> bool:
        """Drop a recovered object not yet back (a remove during recovery); whether it
        was one."""
        found = False
        for objects in self._by_segment.values():
            found = objects.pop(key, None) is not None or found
        return found

    def expire(self, now: float) -> list[str]:
        """Give up segments still missing at the deadline; their ids."""
        if not self.segments or now < self.deadline:
            return []
        gone = list(self.segments)
        for segment_id in gone:
            log.warning("segment %s did not come back within the grace period; dropping "
                        "its %d objects", segment_id, len(self._by_segment.get(segment_id, [])))
            self.give_up(segment_id)
        self._attached.clear()
        return gone


def _clashing(recs: list[ObjRec], segment_id: str) -> set[str]:
    """Keys of records whose ranges on the segment overlap another's. Two live objects never
    share memory, so one of them was removed and its record of removal lost (a damaged
    record the replay skipped); which one the log cannot tell, so neither comes back."""
    spans = sorted((o, o + r.size, r.key) for r in recs for s, o in r.replicas
                   if s == segment_id)
    out: set[str] = set()
    reach, holder = -1, ""
    for start, end, key in spans:
        if start < reach:
            out.update((key, holder))
        if end > reach:
            reach, holder = end, key
    return out
