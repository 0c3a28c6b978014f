"""The master's free-space table: ranges whose release waits, and ranges of dropped segments
held in quarantine. The only writer of both; everyone else frees memory through it.

- **Deferred.** A range a reader may still copy from (its read lease runs) or a writer may
  still copy into (a put or move the master gave up on) is freed at its release time, by
  `release_due` (the core's tick).
- **Held.** A range of a put the journal could not write (`hold`) stays allocated until the
  journal has written what voids that put's record, in case the failed write landed anyway
  (`release_held`): until then a successor replaying the record would serve it from memory
  that another put reused.
- **Quarantine.** When a segment is dropped, its deferred ranges are remembered under its id
  and fence: if the same memory is mounted again under the same fence before they are due,
  they are held allocated again, since a late writer or reader may still touch them (with a
  new fence the owner refuses those transfers itself).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING

from kvpool.clock import Clock
from kvpool.store.master.state import Replica, Segment

if TYPE_CHECKING:
    from kvpool.store.master.tables import SegmentTable


HELD = math.inf
"""The release time of a held range: none until `release_held`."""


class FreeSpace:
    def __init__(self, segments: SegmentTable, clock: Clock) -> None:
        self.segments = segments
        self.clock = clock
        self._deferred: list[tuple[float, Segment, int]] = []  # (free at, segment, offset)
        self._quarantine: dict[str, tuple[int, list[tuple[float, int, int]]]] = {}
        """Dropped segment id -> (its fence, [(free at, offset, size)])."""

    # -- questions --------------------------------------------------------------------------

    def deferred_ranges(self) -> Iterator[tuple[Segment, int]]:
        """(segment, offset) of every range waiting for its release time."""
        return ((seg, offset) for _, seg, offset in self._deferred)

    def num_quarantined(self) -> int:
        """Ranges of dropped segments still held in quarantine."""
        return sum(len(ranges) for _, ranges in self._quarantine.values())

    # -- actions ----------------------------------------------------------------------------

    def free(self, seg: Segment, offset: int) -> None:
        """Free a range now (nothing when its segment is no longer mounted)."""
        if self.segments.get(seg.segment_id) is seg:
            seg.allocator.free(offset)

    def release_at(self, at: float, seg: Segment, offset: int) -> None:
        """Free a range when clock time `at` passes (at the first tick after it)."""
        self._deferred.append((at, seg, offset))

    def free_after(self, replica: Replica, lease_until: float) -> None:
        """Free a replica's range now, or when `lease_until` passes if it is still ahead (a
        reader holding the lease may be copying from it)."""
        if lease_until > self.clock.now():
            self._deferred.append((lease_until, replica.segment, replica.offset))
        else:
            self.free(replica.segment, replica.offset)

    def hold(self, replica: Replica) -> None:
        """Keep a replica's range allocated until `release_held`."""
        self._deferred.append((HELD, replica.segment, replica.offset))

    def release_held(self) -> None:
        """Free every range `hold` kept, and forget those of segments dropped meanwhile."""
        held = [d for d in self._deferred if d[0] == HELD]
        if held:
            self._deferred = [d for d in self._deferred if d[0] != HELD]
            for _, seg, offset in held:
                self.free(seg, offset)
        for sid, (fence, ranges) in list(self._quarantine.items()):
            kept = [r for r in ranges if r[0] != HELD]
            if kept:
                self._quarantine[sid] = (fence, kept)
            else:
                del self._quarantine[sid]

    def release_due(self) -> int:
        """Free the deferred ranges whose time has come and forget quarantined ranges that
        are due; returns the number of ranges freed."""
        now = self.clock.now()
        for sid, (fence, ranges) in list(self._quarantine.items()):
            ranges = [r for r in ranges if r[0] > now]
            if ranges:
                self._quarantine[sid] = (fence, ranges)
            else:
                del self._quarantine[sid]
        due = [d for d in self._deferred if d[0] <= now]
        if due:
            self._deferred = [d for d in self._deferred if d[0] > now]
            for _, seg, offset in due:
                self.free(seg, offset)
        return len(due)

    def quarantine(self, seg: Segment) -> None:
        """`seg` was dropped: move its deferred ranges into quarantine."""
        ranges = seg.allocator.allocated_ranges()
        held = [(at, offset, ranges[offset]) for at, s, offset in self._deferred if s is seg]
        if held:
            self._quarantine[seg.segment_id] = (seg.fence, held)
        self._deferred = [d for d in self._deferred if d[1] is not seg]

    def hold_quarantined(self, seg: Segment) -> None:
        """`seg` is being mounted: keep ranges of the dropped mount of the same memory
        allocated until their release time, unless the owner changed its fence (then
        nobody can write them)."""
        fence, ranges = self._quarantine.pop(seg.segment_id, (0, []))
        if fence != seg.fence and fence and seg.fence:
            return
        now = self.clock.now()
        for release_at, offset, size in ranges:
            if release_at > now and seg.allocator.reserve(offset, size):
                self._deferred.append((release_at, seg, offset))

    def check_integrity(self) -> None:
        """AssertionError unless every deferred range of a mounted segment is allocated
        there once, and no mounted segment has ranges in quarantine."""
        seen: set[tuple[int, int]] = set()
        used: dict[int, dict[int, int]] = {}  # id(segment) -> its ranges, read once
        for _, seg, offset in self._deferred:
            if self.segments.get(seg.segment_id) is not seg:
                continue
            ranges = used.get(id(seg))
            if ranges is None:
                ranges = used[id(seg)] = seg.allocator.allocated_ranges()
            assert offset in ranges, \
                f"deferred range {offset} of {seg.segment_id} is not allocated"
            assert (id(seg), offset) not in seen, \
                f"range {offset} of {seg.segment_id} deferred twice"
            seen.add((id(seg), offset))
        for sid in self._quarantine:
            assert sid not in self.segments, f"mounted {sid} still has quarantined ranges"
