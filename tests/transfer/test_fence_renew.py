"""set_fence on a managed buffer that a same-host writer keeps locked (stopped mid-copy): the
old fence stays in force, as the docstring says, and `renew_managed` replaces the buffer."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from kvpool.errors import TransferTimeout
from kvpool.transfer import TransferConfig, TransferEngine
from tests.support.procs import running, spawn_python, wait_stopped

SIZE = 64 << 10

LOCKED_WRITER = r"""
import os, signal, sys
from kvpool.transfer.segment import SegmentDescriptor
from kvpool.transfer.shm import ShmPeer

descriptor, addr, fence = SegmentDescriptor.from_json(sys.argv[1].encode()), int(sys.argv[2]), int(sys.argv[3])
view, guard = ShmPeer(descriptor).resolve(addr, 4096)
token = guard.enter(fence, True)               # the writer's fence check: shared lock held
print("admitted" if token is not None else "fenced", flush=True)
os.kill(os.getpid(), signal.SIGSTOP)           # stopped between its check and its copy
view[:] = b"\xee" * 4096                       # the late copy
guard.leave(token)
print("copied", flush=True)
"""


def _word(buf: object) -> int:
    with open(f"/dev/shm/{buf.shm_name}", "rb") as f:  # type: ignore[attr-defined]
        return int(np.frombuffer(f.read(16), dtype="<u8")[1])


def test_a_stopped_writer_keeps_the_old_fence_and_renew_replaces_the_buffer() -> None:
    with TransferEngine(TransferConfig(timeout_s=0.25)) as engine:
        buf = engine.allocate_managed(SIZE, fence=7)
        old_name = buf.shm_name
        with running(spawn_python(LOCKED_WRITER, engine.descriptor().to_json().decode(),
                                  str(buf.addr), "7")) as writer:
            assert writer.stdout is not None
            assert writer.stdout.readline().strip() == b"admitted"
            wait_stopped(writer.pid)
            t0 = time.monotonic()
            with pytest.raises(TransferTimeout):
                engine.set_fence(buf.addr, 8)
            assert time.monotonic() - t0 < 5
            assert buf.fence.value == 7 and _word(buf) == 7      # nothing changed: old in force

            fresh = engine.renew_managed(buf, 8)
            assert fresh is not buf and fresh.length == SIZE and fresh.fence.value == 8
            assert _word(fresh) == 8
            assert not os.path.exists(f"/dev/shm/{old_name}")  # the old one is released
            assert [r.name for r in engine.descriptor().shm_regions] == [fresh.shm_name]
            assert engine.registry.find(buf.addr, 1) in (None, fresh)

            writer.send_signal(signal.SIGCONT)
            assert writer.stdout.readline().strip() == b"copied"
            assert writer.wait(10) == 0
        assert not fresh.numpy().any()                         # the late copy landed nowhere


def test_renew_keeps_a_buffer_nobody_holds() -> None:
    with TransferEngine(TransferConfig(timeout_s=0.25)) as engine:
        buf = engine.allocate_managed(SIZE, fence=7)
        assert engine.renew_managed(buf, 9) is buf
        assert buf.fence.value == 9 and _word(buf) == 9
