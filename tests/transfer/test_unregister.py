"""Memory handed back: once `unregister` returns, no write admitted before it still lands
(the caller may free or reuse the memory), and a managed buffer is refused (peers write it
through its file: `free_managed` is the way out); once a wait has failed a batch, none of
its frames still moves bytes."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np
import pytest

from kvpool.errors import MemoryRegistrationError
from kvpool.transfer import OpCode, TransferConfig, TransferEngine, TransferRequest
from tests.transfer.conftest import Target

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


def test_a_batch_given_up_lands_no_byte_after_its_wait_returns(
        target_factory: Callable[..., Target]) -> None:
    """The peer is stopped (SIGSTOP) while a read of 4 MiB is under way on a worker thread:
    the wait fails it, and once it has returned the memory is the caller's again. When the
    peer resumes, nothing lands in it."""
    target = target_factory()
    size = 4 << 20
    target.fill(target.plain, size, seed=5)
    with TransferEngine(TransferConfig(protocol="tcp", timeout_s=5.0)) as engine:
        dst = np.zeros(size, np.uint8)
        engine.register(dst)
        engine.read(target.segment, dst.ctypes.data, target.plain, 4096)   # connected
        with target.stopped():
            batch = engine.allocate_batch(1)
            engine.submit(batch, [TransferRequest(OpCode.READ, dst.ctypes.data, size,
                                                  target.segment, target.plain)])
            (status,) = engine.wait(batch, 0.5)
            assert not status.ok and "not finished" in (status.reason or "")
            engine.unregister(dst.ctypes.data)
            dst[:] = 0x11                                  # the memory is reused
        time.sleep(1.0)
        assert int(np.count_nonzero(dst != 0x11)) == 0, "bytes landed after the wait failed"

