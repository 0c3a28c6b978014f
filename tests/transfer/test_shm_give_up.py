"""A batch given up (its wait timed out) while shared-memory copies of it are still queued
on the copy threads: none of them starts after the wait returned, so no byte lands in
memory the caller has back (tcp frames are shut down for the same promise)."""

from __future__ import annotations

import fcntl
import os
import time

import numpy as np

from kvpool.transfer import TransferConfig, TransferEngine
from kvpool.transfer.batch import OpCode, RequestState, TransferRequest

N = 512 << 10  # above the inline size: an async copy goes to the copy threads


def test_no_byte_lands_after_a_wait_gave_up_on_a_queued_shm_read() -> None:
    b = TransferEngine(TransferConfig(token=None)).start()
    a = TransferEngine(TransferConfig(token=None, timeout_s=2.0)).start()
    try:
        managed = b.allocate_managed(4 * N)
        managed.numpy()[:] = 0x5A
        src, dst = np.ones(2 * N, dtype=np.uint8), np.zeros(N, dtype=np.uint8)
        a.register(src)
        a.register(dst)
        seg = b.segment_name
        assert a.transfer_sync([TransferRequest(OpCode.READ, dst.ctypes.data, 16, seg,
                                                managed.addr)])[0].ok  # mapped, warm
        dst[:] = 0
        # both copy threads held: two writes wait for the file's lock (as large copies, or
        # writers held at a fence change, hold them)
        fd = os.open(f"/dev/shm/{managed.shm_name}", os.O_RDWR)
        fcntl.flock(fd, fcntl.LOCK_EX)
        busy = []
        for k in range(2):
            busy.append(a.allocate_batch(1))
            a.submit(busy[-1], [TransferRequest(OpCode.WRITE, src.ctypes.data + k * N, N, seg,
                                                managed.addr + (2 + k) * N)])
        time.sleep(0.1)
        read = a.allocate_batch(1)
        a.submit(read, [TransferRequest(OpCode.READ, dst.ctypes.data, N, seg, managed.addr)])
        assert a.wait(read, timeout_s=0.2)[0].state == RequestState.FAILED
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
        for bid in busy:
            a.wait(bid, timeout_s=5)
        time.sleep(0.3)
        assert not dst.any(), "bytes of a read reported failed landed after its wait returned"
    finally:
        a.close()
        b.close()
