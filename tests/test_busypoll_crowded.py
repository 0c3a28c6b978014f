"""Busy polling on a crowded machine (kvpool.busypoll): a wait that lost its CPU for longer
than CROWDED_GAP_S between two attempts makes every window of the process block at once for
CROWDED_PAUSE_S; shorter turns of the peer do not. The clock and sched_yield are replaced by a fake time
line, so the outcomes are exact."""

from __future__ import annotations

from typing import Any

import pytest

from kvpool import busypoll
from kvpool.busypoll import CROWDED_GAP_S, CROWDED_PAUSE_S, PollWindow, polled, select_polling


class TimeLine:
    """A clock that only moves when sched_yield is called (by `step_s` each time)."""

    def __init__(self, step_s: float) -> None:
        self.now, self.step_s, self.yields = 100.0, step_s, 0

    def clock(self) -> float:
        return self.now

    def yield_(self) -> None:
        self.yields += 1
        self.now += self.step_s


@pytest.fixture
def line(monkeypatch: pytest.MonkeyPatch) -> TimeLine:
    t = TimeLine(step_s=0.00001)
    monkeypatch.setattr(busypoll, "_clock", t.clock)
    monkeypatch.setattr(busypoll, "_yield", t.yield_)
    monkeypatch.setattr(busypoll, "CROWD", busypoll.Crowd())
    return t


def reader(answer_after: int) -> tuple[Any, Any, list[str]]:
    """attempt() that finds nothing for its first `answer_after` calls; block()."""
    calls: list[str] = []

    def attempt() -> str:
        calls.append("attempt")
        if calls.count("attempt") <= answer_after:
            raise BlockingIOError
        return "polled"

    def block() -> str:
        calls.append("block")
        return "blocked"
    return attempt, block, calls


def test_quick_yields_poll_until_the_answer(line: TimeLine) -> None:
    window = PollWindow(300)
    attempt, block, calls = reader(answer_after=5)
    assert polled(attempt, block, window) == "polled"
    assert (line.yields, busypoll.CROWD.pauses, window.budget_s()) == (5, 0, pytest.approx(0.0003))


def test_a_yield_that_lost_the_cpu_with_nothing_read_pauses_the_window(
        line: TimeLine) -> None:
    window = PollWindow(300)
    line.step_s = 2 * CROWDED_GAP_S  # another process held the CPU
    attempt, block, calls = reader(answer_after=10)
    assert polled(attempt, block, window) == "blocked"
    assert calls == ["attempt", "attempt", "block"] and line.yields == 1
    assert busypoll.CROWD.pauses == 1 and window.budget_s() == 0.0
    attempt, block, calls = reader(answer_after=0)  # within the pause: blocks at once
    assert polled(attempt, block, window) == "blocked" and calls == ["block"]
    assert PollWindow(300).budget_s() == 0.0  # every window of the process
    line.now += CROWDED_PAUSE_S
    assert window.budget_s() == pytest.approx(0.0003)  # polls again after the pause
    line.step_s = 0.00001
    attempt, block, calls = reader(answer_after=2)
    assert polled(attempt, block, window) == "polled" and busypoll.CROWD.pauses == 1


def test_a_long_gap_pauses_even_when_the_answer_came_meanwhile(line: TimeLine) -> None:
    window = PollWindow(300)
    line.step_s = 2 * CROWDED_GAP_S  # the reply waited while others held the CPU
    attempt, block, _ = reader(answer_after=1)
    assert polled(attempt, block, window) == "polled"
    assert busypoll.CROWD.pauses == 1 and window.budget_s() == 0.0


def test_a_peer_turn_shorter_than_the_gap_is_no_crowd(line: TimeLine) -> None:
    window = PollWindow(2000)
    line.step_s = CROWDED_GAP_S / 2
    attempt, block, _ = reader(answer_after=3)
    assert polled(attempt, block, window) == "polled"
    assert (line.yields, busypoll.CROWD.pauses) == (3, 0)


class FakeSelector:
    def __init__(self, ready_after: int) -> None:
        self.calls, self.ready_after = 0, ready_after

    def select(self, timeout: float | None = None) -> list[Any]:
        self.calls += 1
        return [("key", 1)] if timeout or self.calls > self.ready_after else []


def test_select_polling_pauses_on_a_crowd_too(line: TimeLine) -> None:
    window = PollWindow(300)
    assert select_polling(FakeSelector(3), 1.0, window) == [("key", 1)]  # type: ignore[arg-type]
    assert (line.yields, busypoll.CROWD.pauses) == (3, 0)
    line.step_s = 2 * CROWDED_GAP_S
    sel = FakeSelector(5)
    assert select_polling(sel, 1.0, window) == [("key", 1)]  # type: ignore[arg-type]
    assert sel.calls == 3 and busypoll.CROWD.pauses == 1 and window.budget_s() == 0.0
    line.now += CROWDED_PAUSE_S
    line.step_s = 0.00001
    window.observe(0.0)  # (the 2 ms wait cooled the window; a short one warms it again)
    sel = FakeSelector(1)
    assert select_polling(sel, 1.0, window) == [("key", 1)]  # type: ignore[arg-type]
    assert (sel.calls, busypoll.CROWD.pauses) == (2, 1)
