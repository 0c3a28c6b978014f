"""SequenceTracker: every verdict, on its own (no sockets)."""

from __future__ import annotations

from kvpool.kvevents.sequence import Observation, SequenceTracker, Verdict


def test_join_order_gap_stale_restart_per_topic() -> None:
    t = SequenceTracker()
    assert t.observe(b"a", 5) == Observation(Verdict.FIRST)
    assert t.observe(b"a", 6) == Observation(Verdict.IN_ORDER)
    assert t.observe(b"b", 0) == Observation(Verdict.FIRST)
    assert t.observe(b"a", 9) == Observation(Verdict.GAP, 7)
    assert t.expected(b"a") == 10
    assert t.expected(b"a") == 10
    assert t.observe(b"b", 1) == Observation(Verdict.IN_ORDER)
    assert t.observe(b"a", 0) == Observation(Verdict.RESTART)
    assert t.observe(b"a", 1) == Observation(Verdict.IN_ORDER)
    assert t.observe(b"a", 1) == Observation(Verdict.RESTART)  # a new counter whose 0 was lost
    assert t.expected(b"a") == 2


def test_advance_and_forget() -> None:
    t = SequenceTracker()
    assert t.expected(b"x") is None
    t.advance(b"x", 3)
    assert t.observe(b"x", 4) == Observation(Verdict.IN_ORDER)
    t.advance(b"x", 1)  # never moves back
    assert t.expected(b"x") == 5
    t.forget(b"x")
    assert t.observe(b"x", 7) == Observation(Verdict.FIRST)
