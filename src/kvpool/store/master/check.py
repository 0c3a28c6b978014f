"""The master's integrity check: every table checks itself, then all of them are checked
against each other and against the allocators."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvpool.store.master.core_api import CoreApi
    from kvpool.store.master.drain import DrainManager
    from kvpool.store.master.state import Replica
    from kvpool.store.master.tier_state import TierState


def check_master(core: CoreApi, tiering: TierState, drain: DrainManager) -> None:
    core.objects.check_integrity()
    core.segments.check_integrity()
    core.pending.check_integrity()
    core.space.check_integrity()
    expected: dict[str, dict[int, int]] = {sid: {} for sid in core.segments}
    for key, obj in core.objects.items():
        assert key not in core.pending or core.pending[key].upsert, \
            f"{key!r} is both stored and pending without upsert"
        _collect(core, key, obj.replicas, expected)
    for key, put in core.pending.items():
        _collect(core, key, put.replicas, expected)
    for seg, offset, size in tiering.held_ranges():
        assert offset not in expected[seg.segment_id], f"task range {offset} also used"
        expected[seg.segment_id][offset] = size
    drain.check()
    for target in drain.target_ranges():
        _collect(core, "a move", [target], expected)
    for seg, offset in core.space.deferred_ranges():
        if core.segments.get(seg.segment_id) is seg:
            expected[seg.segment_id][offset] = seg.allocator.rounded(1)  # size checked below
    for sid, seg in core.segments.items():
        seg.allocator.check_integrity()
        ranges = seg.allocator.allocated_ranges()
        assert set(ranges) == set(expected[sid]), (
            f"segment {sid}: allocated offsets {sorted(ranges)} != referenced "
            f"{sorted(expected[sid])}")
        for key in seg.keys:
            assert key in core.objects, f"{sid} lists removed key {key!r}"
        for key in seg.pending_keys:
            assert key in core.pending, f"{sid} lists ended put {key!r}"
        assert seg.client_id in core.clients, f"{sid} belongs to unknown client"
    tiering.check_integrity()


def _collect(core: CoreApi, key: str, replicas: list[Replica],
             expected: dict[str, dict[int, int]]) -> None:
    seen = set()
    for r in replicas:
        sid = r.segment.segment_id
        assert core.segments.get(sid) is r.segment, f"{key!r} has a replica on gone {sid}"
        assert sid not in seen, f"{key!r} has two replicas on {sid}"
        seen.add(sid)
        assert r.offset not in expected[sid], f"{key!r} shares offset {r.offset} in {sid}"
        expected[sid][r.offset] = r.size
