"""Factories for store tests."""

from __future__ import annotations

import pytest

from kvpool.clock import VirtualClock
from kvpool.store.config import MasterConfig
from kvpool.store.master_core import MasterCore

KIB = 1024


def make_core(clock: VirtualClock, num_segments: int = 2, capacity: int = 64 * KIB,
              **overrides: object) -> MasterCore:
    """A master on a virtual clock with `num_segments` segments of distinct clients."""
    core = MasterCore(MasterConfig(seed=7, **overrides), clock)  # type: ignore[arg-type]
    for i in range(num_segments):
        code, _ = core.mount_segment(f"c{i}", f"127.0.0.1:{9000 + i}", 0x10000, capacity)
        assert code == 0
    return core


@pytest.fixture
def core(vclock: VirtualClock) -> MasterCore:
    return make_core(vclock)
