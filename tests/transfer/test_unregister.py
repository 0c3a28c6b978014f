"""Unregistering memory: once `unregister` returns, no write admitted before it still lands
(the caller may free or reuse the memory), and a managed buffer is refused (peers write it
through its file: `free_managed` is the way out)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from kvpool.errors import MemoryRegistrationError
from kvpool.transfer import OpCode, TransferConfig, TransferEngine, TransferRequest

SIZE = 128 << 20


def test_unregister_returns_only_after_the_writes_admitted_into_the_region() -> None:
    """A 128 MiB write over tcp is landing when the target unregisters the region: the call
    waits for it, so nothing lands in the memory after it returns."""
    one_frame = TransferConfig(protocol="tcp", slice_bytes=SIZE, frame_bytes=SIZE,
                               small_frame_bytes=SIZE)
    with TransferEngine(TransferConfig(protocol="tcp")) as target, \
            TransferEngine(one_frame) as initiator:
        region = np.zeros(SIZE, np.uint8)
        target.register_address(region.ctypes.data, SIZE)
        src = np.full(SIZE, 0x5A, np.uint8)
        initiator.register(src)
        initiator.write(target.segment_name, src.ctypes.data, region.ctypes.data, 4096)
        region[:4096] = 0
        statuses: list[object] = []
        writer = threading.Thread(target=lambda: statuses.extend(initiator.transfer_sync(
            [TransferRequest(OpCode.WRITE, src.ctypes.data, SIZE, target.segment_name,
                             region.ctypes.data)])))
        writer.start()
        deadline = time.monotonic() + 10
        while region[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.0002)
        assert region[0] == 0x5A, "the write never started landing"
        target.unregister(region.ctypes.data)
        landed = int(np.count_nonzero(region))
        region[:] = 0                                   # the caller reuses the memory
        writer.join(10)
        time.sleep(0.2)
        assert int(np.count_nonzero(region)) == 0, "bytes landed after unregister returned"
        assert len(statuses) == 1
        assert landed == SIZE, "the write admitted before was not waited for"
        again = initiator.transfer_sync([TransferRequest(
            OpCode.WRITE, src.ctypes.data, 4096, target.segment_name, region.ctypes.data)])
        assert not again[0].ok                           # not registered any more


def test_a_managed_buffer_is_freed_not_unregistered() -> None:
    with TransferEngine(TransferConfig()) as engine:
        buf = engine.allocate_managed(1 << 16)
        with pytest.raises(MemoryRegistrationError, match="free_managed"):
            engine.unregister(buf.addr)
        assert engine.descriptor().shm_regions[0].addr == buf.addr   # still served
        engine.free_managed(buf)
        assert not engine.descriptor().shm_regions
