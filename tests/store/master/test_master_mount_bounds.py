"""MasterCore refuses mounts outside the address space itself, not only behind the service."""

from __future__ import annotations

import pytest

from kvpool.clock import VirtualClock
from kvpool.store.config import MasterConfig
from kvpool.store.master.core import MasterCore
from kvpool.store.wire.codes import ErrorCode as E

TOP = 1 << 64


@pytest.mark.parametrize(("base", "size", "fence"), [
    (TOP - 4096, 4096, 0), (TOP - 4096, 8192, 0), (TOP, 4096, 0), (-1, 4096, 0),
    (0, 4096, TOP), (0, 4096, -1), (0, 4096, 1.5), (0, 4096, True), (0.0, 4096, 0)])
def test_core_refuses_a_mount_outside_u64(base: object, size: int, fence: object) -> None:
    core = MasterCore(MasterConfig(), VirtualClock())
    assert core.mount_segment("c", "127.0.0.1:9000", base, size, fence=fence) \
        == (E.INVALID_PARAMS, "")  # type: ignore[arg-type]
    assert len(core.segments) == 0


def test_core_takes_the_highest_mount_that_fits() -> None:
    core = MasterCore(MasterConfig(), VirtualClock())
    code, _ = core.mount_segment("c", "127.0.0.1:9000", TOP - 4097, 4096, fence=TOP - 1)
    assert code == E.OK
