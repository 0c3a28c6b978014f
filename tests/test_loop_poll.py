"""The event loop's busy polling (kvpool.loop_poll) on a real asyncio loop, with the clock and
sched_yield replaced by a time line that moves a step per turn, so the stretches' lengths are
exact: a kick polls for the window and no longer, a kick within it extends it, nothing polls
while many requests are in flight or the machine is crowded, and a window of 0 never polls."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from kvpool import busypoll, loop_poll
from kvpool.busypoll import CROWDED_GAP_S
from kvpool.errors import ConfigError
from kvpool.loop_poll import CROWDED_PAUSE_S, LoopPoller
from kvpool.serve.config import ProxyConfig

STEP_S = 0.00001
WINDOW_US = 1000
TURNS = round(WINDOW_US / 1e6 / STEP_S)
"""Turns of one stretch that no kick extends."""


class TimeLine:
    """A clock that moves `step_s` at each sched_yield (one turn of a stretch); `at_turn` runs
    a callback on the turn it names."""

    def __init__(self) -> None:
        self.now, self.step_s, self.turns = 100.0, STEP_S, 0
        self.at_turn: dict[int, Callable[[], None]] = {}

    def clock(self) -> float:
        return self.now

    def yield_(self) -> None:
        self.turns += 1
        self.now += self.step_s
        action = self.at_turn.pop(self.turns, None)
        if action is not None:
            action()


@pytest.fixture
def line(monkeypatch: pytest.MonkeyPatch) -> TimeLine:
    t = TimeLine()
    monkeypatch.setattr(loop_poll, "_yield", t.yield_)
    monkeypatch.setattr(busypoll, "CROWD", busypoll.Crowd())
    return t


class Load:
    def __init__(self, in_flight: int = 0) -> None:
        self.in_flight = in_flight


def run(line: TimeLine, body: Callable[[LoopPoller], object], window_us: int = WINDOW_US,
        load: Load | None = None) -> LoopPoller:
    """`body(poller)` on a started poller (at most 4 requests in flight for it to poll), then
    50 ms of real time for its stretches to end."""
    async def main() -> LoopPoller:
        poller = LoopPoller(window_us, load or Load(), 4, clock=line.clock)
        poller.start()
        body(poller)
        await asyncio.sleep(0.05)
        await poller.stop()
        return poller
    return asyncio.run(main())


def test_a_kick_polls_the_loop_for_the_window_and_no_longer(line: TimeLine) -> None:
    ran: list[int] = []

    def kick(p: LoopPoller) -> None:
        p.kick()
        asyncio.get_running_loop().call_later(0.001, lambda: ran.append(line.turns))

    poller = run(line, kick)
    assert poller.stretches == 1
    assert TURNS <= line.turns <= TURNS + 2
    assert ran  # the loop ran its other callbacks meanwhile


def test_a_kick_within_the_window_extends_the_stretch(line: TimeLine) -> None:
    def kicks(p: LoopPoller) -> None:
        p.kick()
        line.at_turn[TURNS // 2] = p.kick
    poller = run(line, kicks)
    assert poller.stretches == 1
    assert TURNS // 2 + TURNS <= line.turns <= TURNS // 2 + TURNS + 2


def test_nothing_polls_while_many_requests_are_in_flight(line: TimeLine) -> None:
    load = Load(in_flight=5)
    assert run(line, LoopPoller.kick, load=load).stretches == 0
    assert line.turns == 0

    load.in_flight = 4

    def kick_then_more(p: LoopPoller) -> None:
        p.kick()
        line.at_turn[10] = lambda: setattr(load, "in_flight", 5)
    assert run(line, kick_then_more, load=load).stretches == 1
    assert line.turns == 10  # the stretch ended at the first turn that found more in flight


def test_a_crowded_turn_pauses_polling(line: TimeLine) -> None:
    def crowded(p: LoopPoller) -> None:
        p.kick()
        line.at_turn[5] = lambda: setattr(line, "now", line.now + 2 * CROWDED_GAP_S)
    run(line, crowded)
    assert line.turns == 5  # the turn after the lost time slice saw it, and stopped
    assert busypoll.CROWD.resume_at == pytest.approx(line.now + CROWDED_PAUSE_S)

    turns = line.turns
    assert run(line, LoopPoller.kick).stretches == 0  # within the pause
    assert line.turns == turns
    line.now += CROWDED_PAUSE_S
    assert run(line, LoopPoller.kick).stretches == 1
    assert turns + TURNS <= line.turns <= turns + TURNS + 2


def test_a_window_of_0_never_polls(line: TimeLine) -> None:
    assert run(line, LoopPoller.kick, window_us=0).stretches == 0
    assert line.turns == 0


@pytest.mark.parametrize("window_us", [-1, busypoll.MAX_WINDOW_US + 1])
def test_a_window_out_of_bounds_is_refused(window_us: int) -> None:
    with pytest.raises(ConfigError, match="poll"):
        LoopPoller(window_us, Load(), 4)
    with pytest.raises(ConfigError, match="loop_poll_us"):
        ProxyConfig(model_dir="m", loop_poll_us=window_us)
