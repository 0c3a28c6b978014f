"""Factories for store tests."""

from __future__ import annotations

import pytest

from kvpool.clock import VirtualClock
from kvpool.store.config import MasterConfig
from kvpool.store.master.core import MasterCore

KIB = 1024


def make_core(clock: VirtualClock, num_segments: int = 2, capacity: int = 64 * KIB,
              **overrides: object) -> MasterCore:
    """A master on a virtual clock with `num_segments` segments of distinct clients."""
    core = MasterCore(MasterConfig(seed=7, **overrides), clock)  # type: ignore[arg-type]
    for i in range(num_segments):
        code, _ = core.mount_segment(f"c{i}", f"127.0.0.1:{9000 + i}", 0x10000, capacity)
        assert code == 0
    return core


def live_for(core: MasterCore, clock: VirtualClock, seconds: float,
             clients: tuple[str, ...] = ("w", "c0", "c1"), step: float = 2.5) -> None:
    """Let `seconds` pass on a master that ticks every `step` (so none of it is a stall of
    the master's own) while `clients` heartbeat before each tick."""
    while seconds > 0:
        clock.advance(min(step, seconds))
        seconds -= step
        for client in clients:
            core.heartbeat(client)
        core.tick()


@pytest.fixture
def core(vclock: VirtualClock) -> MasterCore:
    return make_core(vclock)
