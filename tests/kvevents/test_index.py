"""CacheIndex: prefix matches per medium, removal, clears, and the never-matched alarm."""

from __future__ import annotations

from kvpool.kvevents.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from kvpool.kvevents.index import CacheIndex


def batch(*events: object) -> EventBatch:
    return EventBatch(ts=0.0, events=list(events))  # type: ignore[arg-type]


def stored(hashes: list[int], medium: str | None = "GPU", group: int | None = None) -> BlockStored:
    return BlockStored(block_hashes=hashes, token_ids=[], block_size=16, medium=medium, group_idx=group)


def test_longest_held_prefix_per_medium() -> None:
    index = CacheIndex()
    index.apply("a", batch(stored([1, 2, 3]), stored([1, 2], "cpu"), stored([9], "disk")))
    index.apply("a", batch(stored([4], None)))  # no medium: the GPU cache
    assert index.matched_blocks("a", [1, 2, 3, 4, 5]) == 4
    assert index.matched_blocks("a", [1, 2, 3], "CPU") == 2
    assert index.matched_blocks("a", [2, 3]) == 2 and index.matched_blocks("a", [7, 1]) == 0
    assert index.matched_blocks("a", [9], "STORAGE") == 1
    assert index.matched_blocks("b", [1]) == 0
    assert index.media("a") == ["cpu", "disk", "gpu"] and index.num_blocks("a") == 4
    index.check_integrity()


def test_removal_clear_and_other_groups() -> None:
    index = CacheIndex()
    index.apply("a", batch(stored([1, 2, 3]), BlockRemoved(block_hashes=[2], medium="GPU"),
                           stored([7], group=1)))
    assert index.matched_blocks("a", [1, 2, 3]) == 1
    assert index.matched_blocks("a", [7]) == 0
    index.apply("a", batch(BlockRemoved(block_hashes=[3], medium="cpu")))
    assert index.num_blocks("a") == 2
    index.apply("a", batch(AllBlocksCleared(), stored([5])))
    assert index.num_blocks("a") == 1 and index.matched_blocks("a", [5]) == 1
    index.clear("a")
    assert index.num_blocks("a") == 0 and index.instances() == ["a"]
    assert index.stats("a").num_cleared_events == 1
    index.drop("a")
    assert index.instances() == []


def test_never_matched_after_enough_lookups_with_blocks() -> None:
    index = CacheIndex(alarm_after_lookups=3)
    index.apply("wrong", batch(stored([100, 101])))
    for i in range(1, 4):
        index.note_lookup("wrong", [1, 2])
        assert index.never_matched("wrong") == (i == 3)
    index.apply("wrong", batch(stored([102])))
    assert index.never_matched("wrong")
    assert index.stats("wrong").num_unmatched_stored_events == 1


def test_a_stored_event_meeting_a_lookup_is_a_match() -> None:
    index = CacheIndex(alarm_after_lookups=2)
    index.note_lookup("ok", [1, 2])  # nothing stored yet: does not count toward the alarm
    index.apply("ok", batch(stored([1, 2])))
    index.note_lookup("ok", [3])
    index.note_lookup("ok", [4])
    assert index.stats("ok").num_matches == 1 and not index.never_matched("ok")
    assert index.stats("ok").num_lookups_with_blocks == 2
    assert not index.never_matched("nobody")
    index.check_integrity()


def test_the_alarm_is_logged_once(caplog: object) -> None:
    import logging

    index = CacheIndex(alarm_after_lookups=2)
    index.apply("x", batch(stored([100])))
    with caplog.at_level(logging.WARNING, logger="kvpool.kvevents.index"):  # type: ignore[attr-defined]
        for _ in range(4):
            index.note_lookup("x", [1])
    warnings = [r for r in caplog.records if "never match" in r.getMessage()]  # type: ignore[attr-defined]
    assert len(warnings) == 1 and "x" in warnings[0].getMessage()
