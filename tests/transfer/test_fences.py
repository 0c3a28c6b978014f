"""Write fences: a fenced region refuses requests planned against another fence, on every route."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from kvpool.errors import InvalidArgument, MemoryRegistrationError, TransferError
from kvpool.transfer import OpCode, RequestState, TransferConfig, TransferEngine, TransferRequest
from kvpool.transfer.fence import Fence
from kvpool.transfer.protocol import FENCED_REASON
from tests.transfer.conftest import Target, remote_base, sha

SIZE = 64 << 10


def _fill(engine: TransferEngine, seed: int) -> np.ndarray:
    buf = engine.allocate_managed(SIZE).numpy()
    buf[:] = np.random.default_rng(seed).integers(0, 256, SIZE, dtype=np.uint8)
    return buf


def _write(engine: TransferEngine, local: np.ndarray, segment: str, addr: int, fence: int) -> list:
    return engine.transfer_sync([TransferRequest(OpCode.WRITE, local.ctypes.data, SIZE, segment, addr, fence)])


def test_stale_fence_is_refused_and_touches_nothing(engine: TransferEngine, target: Target,
                                                     transport: str) -> None:
    base = remote_base(target, transport)
    target.set_fence(base, 5)
    first, second = _fill(engine, 1), _fill(engine, 2)
    assert _write(engine, first, target.segment, base, 5)[0].ok
    assert target.digest(base, SIZE) == sha(first)
    target.set_fence(base, 6)  # the region was handed out again
    for fence in (5, 0):
        status = _write(engine, second, target.segment, base, fence)[0]
        assert status.state == RequestState.FAILED and status.reason == FENCED_REASON
    assert target.digest(base, SIZE) == sha(first)
    back = engine.allocate_managed(SIZE).numpy()
    stale_read = engine.transfer_sync([TransferRequest(OpCode.READ, back.ctypes.data, SIZE,
                                                       target.segment, base, 5)])[0]
    assert stale_read.reason == FENCED_REASON
    assert _write(engine, second, target.segment, base, 6)[0].ok
    assert target.digest(base, SIZE) == sha(second)


def test_fences_are_per_descriptor_in_one_frame(engine: TransferEngine, target: Target,
                                               transport: str) -> None:
    base = remote_base(target, transport)
    target.set_fence(base, 9)
    local = _fill(engine, 3)
    reqs = [TransferRequest(OpCode.WRITE, local.ctypes.data + i * 4096, 4096, target.segment,
                            base + i * 4096, 9 if i % 2 else 8) for i in range(8)]
    statuses = engine.transfer_sync(reqs)
    assert [s.ok for s in statuses] == [False, True] * 4
    for i in (1, 3):
        assert target.digest(base + i * 4096, 4096) == sha(local[i * 4096 : (i + 1) * 4096])


def test_runs_of_one_fence_in_a_frame_are_admitted_or_refused_whole(
        engine: TransferEngine, target: Target, transport: str) -> None:
    base = remote_base(target, transport)
    target.set_fence(base, 9)
    fences = [9, 9, 9, 8, 8, 9, 0, 9]
    before = [target.digest(base + i * 4096, 4096) for i in range(len(fences))]
    local = _fill(engine, 7)
    reqs = [TransferRequest(OpCode.WRITE, local.ctypes.data + i * 4096, 4096, target.segment,
                            base + i * 4096, f) for i, f in enumerate(fences)]
    statuses = engine.transfer_sync(reqs)
    assert [s.ok for s in statuses] == [f == 9 for f in fences]
    assert all(s.reason == FENCED_REASON for s, f in zip(statuses, fences, strict=True) if f != 9)
    back = engine.allocate_managed(SIZE).numpy()
    engine.transfer_sync([TransferRequest(OpCode.READ, back.ctypes.data, SIZE, target.segment,
                                          base, 9)])
    for i, f in enumerate(fences):  # the admitted runs landed, the refused ones touched nothing
        want = sha(local[i * 4096:(i + 1) * 4096]) if f == 9 else before[i]
        assert sha(back[i * 4096:(i + 1) * 4096]) == want


def test_reads_of_a_frame_are_admitted_per_run_of_one_fence(
        engine: TransferEngine, target: Target, transport: str) -> None:
    base = remote_base(target, transport)
    target.set_fence(base, 9)
    written = _fill(engine, 11)
    assert _write(engine, written, target.segment, base, 9)[0].ok
    fences = [9, 9, 8, 8, 9, 0, 9, 9, 9]
    addrs = [base + i * 4096 for i in range(len(fences))]
    addrs[7] = 1 << 62                               # outside every region, then back in
    back = engine.allocate_managed(SIZE).numpy()
    back[:] = 0xAB
    reqs = [TransferRequest(OpCode.READ, back.ctypes.data + i * 4096, 4096, target.segment,
                            addr, f) for i, (addr, f) in enumerate(zip(addrs, fences, strict=True))]
    statuses = engine.transfer_sync(reqs)
    assert [s.ok for s in statuses] == [f == 9 and i != 7 for i, f in enumerate(fences)]
    assert all(statuses[i].reason == FENCED_REASON for i in (2, 3, 5))
    for i, s in enumerate(statuses):  # admitted reads brought the bytes, refused ones none
        got = back[i * 4096:(i + 1) * 4096]
        assert sha(got) == (sha(written[i * 4096:(i + 1) * 4096]) if s.ok else
                            sha(np.full(4096, 0xAB, dtype=np.uint8)))


def test_set_fence_waits_for_every_write_of_a_run() -> None:
    fence = Fence(1)
    token = fence.enter(1, write=True, count=3)
    assert token is not None
    returned = threading.Event()
    setter = threading.Thread(target=lambda: (fence.set(2, 5.0), returned.set()))
    setter.start()
    fence.leave(token, 2)
    assert not returned.wait(0.2)  # one of the three is still copying
    fence.leave(token)
    assert returned.wait(5)
    setter.join()


def test_unfenced_region_accepts_any_request_fence(engine: TransferEngine, target: Target,
                                                   transport: str) -> None:
    base = remote_base(target, transport)
    local = _fill(engine, 4)
    assert _write(engine, local, target.segment, base, 1234)[0].ok
    target.set_fence(base, 7)
    target.set_fence(base, 0)  # back to unfenced
    assert _write(engine, local, target.segment, base, 0)[0].ok
    assert target.digest(base, SIZE) == sha(local)


def test_own_segment_copies_check_the_fence() -> None:
    with TransferEngine(TransferConfig()) as engine:
        src = _fill(engine, 5)
        dest = np.zeros(SIZE, dtype=np.uint8)
        region = engine.register(dest, fence=3)
        assert _write(engine, src, engine.segment_name, region.addr, 3)[0].ok
        engine.set_fence(region.addr, 4)
        status = _write(engine, _fill(engine, 6), engine.segment_name, region.addr, 3)[0]
        assert status.reason == FENCED_REASON
        assert sha(dest) == sha(src)
        managed = engine.allocate_managed(SIZE, fence=11)
        assert _write(engine, src, engine.segment_name, managed.addr, 11)[0].ok
        assert not _write(engine, src, engine.segment_name, managed.addr, 12)[0].ok


def test_set_fence_waits_for_a_write_admitted_under_the_old_fence() -> None:
    fence = Fence(1)
    token = fence.enter(1, write=True)
    assert token is not None
    returned = threading.Event()
    setter = threading.Thread(target=lambda: (fence.set(2, 5.0), returned.set()))
    setter.start()
    assert not returned.wait(0.2)  # the old write is still copying
    assert fence.enter(1, write=True) is None  # but no new write gets in under the old fence
    new = fence.enter(2, write=True)
    assert new is not None and not returned.is_set()  # writes under the new fence don't block it
    fence.leave(token)
    assert returned.wait(5)
    fence.leave(new)
    setter.join()


def test_fence_api_misuse_raises() -> None:
    with TransferEngine(TransferConfig()) as engine:
        buf = engine.allocate_managed(4096)
        with pytest.raises(InvalidArgument):
            engine.set_fence(buf.addr, -1)
        with pytest.raises(InvalidArgument):
            engine.set_fence(buf.addr, 1 << 64)
        with pytest.raises(MemoryRegistrationError):
            engine.set_fence(buf.addr + 1, 1)
        with pytest.raises(InvalidArgument):
            engine.register(np.zeros(16, dtype=np.uint8), fence=-5)


def test_registering_again_keeps_or_replaces_the_fence() -> None:
    with TransferEngine(TransferConfig()) as engine:
        dest = np.zeros(SIZE, dtype=np.uint8)
        region = engine.register(dest, fence=3)
        assert engine.register(dest) is region and region.fence.value == 3  # 0 keeps it
        assert engine.register(dest, fence=4) is region and region.fence.value == 4
        src = _fill(engine, 7)
        assert _write(engine, src, engine.segment_name, region.addr, 3)[0].reason == FENCED_REASON
        assert _write(engine, src, engine.segment_name, region.addr, 4)[0].ok


def test_sync_helpers_carry_the_fence(engine: TransferEngine, target: Target, transport: str) -> None:
    base = remote_base(target, transport)
    target.set_fence(base, 21)
    local = _fill(engine, 8)
    engine.write(target.segment, local.ctypes.data, base, SIZE, fence=21)
    with pytest.raises(TransferError, match="stale fence"):
        engine.write(target.segment, local.ctypes.data, base, SIZE, fence=20)
    with pytest.raises(TransferError, match="stale fence"):
        engine.batch_read(target.segment, [(local.ctypes.data, base, 16)], fence=20)
    engine.batch_read(target.segment, [(local.ctypes.data, base, 16)], fence=21)
