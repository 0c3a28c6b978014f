"""The gate of the admin's /integrity on a virtual clock: one run at a time, then a rest
that keeps the runs to their share of the time."""

from __future__ import annotations

from kvpool.clock import VirtualClock
from kvpool.store.master.admin import BUSY_RETRY_S, _DutyCycle


def test_a_run_of_d_seconds_rests_the_gate_for_its_share() -> None:
    clock = VirtualClock(50.0)
    gate = _DutyCycle(0.2, clock)          # a run of d: a rest of 4 d
    assert gate.claim() == 0.0
    assert gate.claim() == BUSY_RETRY_S     # one caller at a time
    clock.advance(0.5)
    gate.release(0.5)
    assert gate.claim() == 2.0
    clock.advance(1.5)
    assert gate.claim() == 0.5
    clock.advance(0.5)
    assert gate.claim() == 0.0
