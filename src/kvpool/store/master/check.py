"""The master's integrity check: every table agrees with the others and the allocators."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvpool.store.master.core import MasterCore


def check_master(core: MasterCore) -> None:
    core.objects.check_integrity()
    core.segments.check_integrity()
    expected: dict[str, dict[int, int]] = {sid: {} for sid in core.segments}
    for key, obj in core.objects.items():
        assert key not in core.pending or core.pending[key].upsert, \
            f"{key!r} is both stored and pending without upsert"
        _collect(core, key, obj.replicas, expected)
    for key, put in core.pending.items():
        _collect(core, key, put.replicas, expected)
        for r in put.replicas:
            assert key in r.segment.pending_keys, f"pending {key!r} not indexed"
    for seg, offset, size in core.tiering.held_ranges():
        assert offset not in expected[seg.segment_id], f"task range {offset} also used"
        expected[seg.segment_id][offset] = size
    core.drain.check()
    for target in core.drain.target_ranges():
        _collect(core, "a move", [target], expected)
    for _, seg, offset in core._deferred:
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
        assert seg.client_id in core.clients, f"{sid} belongs to unknown client"
    core.tiering.check_integrity()


def _collect(core: MasterCore, key: str, replicas: list, expected: dict) -> None:  # type: ignore[type-arg]
    seen = set()
    for r in replicas:
        sid = r.segment.segment_id
        assert core.segments.get(sid) is r.segment, f"{key!r} has a replica on gone {sid}"
        assert sid not in seen, f"{key!r} has two replicas on {sid}"
        seen.add(sid)
        assert r.offset not in expected[sid], f"{key!r} shares offset {r.offset} in {sid}"
        expected[sid][r.offset] = r.size
