"""The conformance suite every transport runs (target in another process, real sockets/shm)."""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest

from kvpool.errors import TransferError
from kvpool.transfer import OpCode, RequestState, TransferConfig, TransferEngine, TransferRequest
from tests.support.net import free_port
from tests.transfer.conftest import Target, remote_base, sha


def _local(engine: TransferEngine, size: int, seed: int) -> np.ndarray:
    buf = engine.allocate_managed(size).numpy()
    buf[:] = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)
    return buf


def test_round_trips_at_random_sizes_and_offsets(engine: TransferEngine, target: Target, transport: str) -> None:
    rng = np.random.default_rng(1)
    local = _local(engine, 4 << 20, seed=2)
    back = engine.allocate_managed(4 << 20).numpy()
    base = remote_base(target, transport)
    for _ in range(12):
        length = int(rng.choice([1, 7, 4096, 65_537, 1 << 20, 3 << 20]))
        src_off = int(rng.integers(0, local.nbytes - length + 1))
        dst_off = int(rng.integers(0, target.size - length + 1))
        engine.write(target.segment, local.ctypes.data + src_off, base + dst_off, length)
        assert target.digest(base + dst_off, length) == sha(local[src_off : src_off + length])
        engine.read(target.segment, back.ctypes.data, base + dst_off, length)
        assert sha(back[:length]) == sha(local[src_off : src_off + length])


def test_batch_of_mixed_reads_and_writes_reports_each(engine: TransferEngine, target: Target, transport: str) -> None:
    local = _local(engine, 1 << 20, seed=3)
    base = remote_base(target, transport)
    target.fill(base, 1 << 20, seed=9)
    expected_remote = np.random.default_rng(9).integers(0, 256, 1 << 20, dtype=np.uint8)
    dest = engine.allocate_managed(1 << 20).numpy()
    reqs = [TransferRequest(OpCode.READ, dest.ctypes.data + i * 4096, 4096, target.segment, base + i * 4096)
            for i in range(64)]
    reqs += [TransferRequest(OpCode.WRITE, local.ctypes.data + i * 4096, 4096, target.segment,
                             base + (512 << 10) + i * 4096) for i in range(64)]
    batch = engine.allocate_batch(len(reqs))
    engine.submit(batch, reqs)
    statuses = engine.wait(batch, timeout_s=10)
    engine.free_batch(batch)
    assert [s.state for s in statuses] == [RequestState.DONE] * 128
    assert sha(dest[: 64 * 4096]) == sha(expected_remote[: 64 * 4096])
    assert target.digest(base + (512 << 10), 64 * 4096) == sha(local[: 64 * 4096])


def test_many_concurrent_batches(engine: TransferEngine, target: Target, transport: str) -> None:
    local = _local(engine, 2 << 20, seed=4)
    base = remote_base(target, transport)
    errors: list[str] = []

    def worker(k: int) -> None:
        region = k * (256 << 10)
        reqs = [TransferRequest(OpCode.WRITE, local.ctypes.data + region + i * 8192, 8192, target.segment,
                                base + region + i * 8192) for i in range(32)]
        for _ in range(5):
            statuses = engine.transfer_sync(reqs)
            errors.extend(s.reason or "" for s in statuses if not s.ok)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == []
    assert target.digest(base, 2 << 20) == sha(local)


def test_out_of_range_request_fails_alone_and_touches_nothing(engine: TransferEngine, target: Target,
                                                             transport: str) -> None:
    local = _local(engine, 64 << 10, seed=5)
    base = remote_base(target, transport)
    target.fill(base, target.size, seed=6)
    before = target.digest(base, target.size)
    end = base + target.size
    reqs = [
        TransferRequest(OpCode.WRITE, local.ctypes.data, 4096, target.segment, end - 100),  # straddles the end
        TransferRequest(OpCode.WRITE, local.ctypes.data, 4096, target.segment, 4096),  # unmapped address
        TransferRequest(OpCode.READ, local.ctypes.data, 4096, target.segment, end + (1 << 30)),
    ]
    statuses = engine.transfer_sync(reqs)
    assert [s.state for s in statuses] == [RequestState.FAILED] * 3
    assert all("not inside" in (s.reason or "") for s in statuses)
    assert target.digest(base, target.size) == before
    ok = engine.transfer_sync([TransferRequest(OpCode.WRITE, local.ctypes.data, 4096, target.segment, base)])
    assert ok[0].ok


def test_unregistered_local_buffer_fails_with_reason(engine: TransferEngine, target: Target, transport: str) -> None:
    stray = np.zeros(4096, dtype=np.uint8)  # never registered
    statuses = engine.transfer_sync([TransferRequest(OpCode.WRITE, stray.ctypes.data, 4096, target.segment,
                                                     remote_base(target, transport))])
    assert statuses[0].state == RequestState.FAILED
    assert "not registered" in (statuses[0].reason or "")


def test_unknown_segment_fails_fast(engine: TransferEngine) -> None:
    local = _local(engine, 4096, seed=7)
    start = time.monotonic()
    statuses = engine.transfer_sync([TransferRequest(OpCode.WRITE, local.ctypes.data, 4096,
                                                     f"127.0.0.1:{free_port()}", 0x1000)])
    assert statuses[0].state == RequestState.FAILED
    assert "connect" in (statuses[0].reason or "")
    assert time.monotonic() - start < 5
    with pytest.raises(TransferError):
        engine.write("not-a-segment", local.ctypes.data, 0x1000, 16)


def test_dead_peer_mid_batch_fails_and_next_submit_reconnects(engine: TransferEngine, transport: str,
                                                              target_factory: Callable[..., Target]) -> None:
    port = free_port()
    target = target_factory(port=port, timeout_s=5.0)
    local = _local(engine, 8 << 20, seed=8)
    base = remote_base(target, transport)
    reqs = [TransferRequest(OpCode.WRITE, local.ctypes.data + i * (256 << 10), 256 << 10, target.segment,
                            base + i * (256 << 10)) for i in range(32)]
    assert all(s.ok for s in engine.transfer_sync(reqs))
    for _ in range(20):  # keep the peer busy, then kill it in the middle of a batch
        batch = engine.allocate_batch(len(reqs))
        engine.submit(batch, reqs)
        if _ == 3:
            target.proc.send_signal(signal.SIGKILL)
        statuses = engine.wait(batch, timeout_s=10)
        engine.free_batch(batch)
        assert all(s.state in (RequestState.DONE, RequestState.FAILED) for s in statuses)
        if any(not s.ok for s in statuses):
            break
    else:
        pytest.fail("requests to a killed peer never failed")
    target.proc.wait()
    statuses = engine.transfer_sync(reqs[:4])
    assert all(s.state == RequestState.FAILED for s in statuses)
    revived = target_factory(port=port)
    base = remote_base(revived, transport)
    fresh = [TransferRequest(OpCode.WRITE, local.ctypes.data, 1 << 20, revived.segment, base)]
    statuses = engine.transfer_sync(fresh)
    assert statuses[0].ok, statuses[0].reason
    assert revived.digest(base, 1 << 20) == sha(local[: 1 << 20])


def test_token_mismatch_is_refused(transport: str, target_factory: Callable[..., Target]) -> None:
    target = target_factory(token="s3cret")
    protocol = "tcp" if transport == "tcp" else "auto"
    for token, expect_ok in (("wrong", False), (None, False), ("s3cret", True)):
        with TransferEngine(TransferConfig(protocol=protocol, token=token)) as eng:
            local = _local(eng, 4096, seed=1)
            statuses = eng.transfer_sync([TransferRequest(OpCode.WRITE, local.ctypes.data, 4096, target.segment,
                                                          remote_base(target, transport))])
            assert statuses[0].ok is expect_ok, statuses[0].reason
            if not expect_ok:
                assert "token" in (statuses[0].reason or "")


def test_hung_peer_fails_within_timeout(target_factory: Callable[..., Target]) -> None:
    """TCP only: a stopped process cannot block a memcpy into its shared buffer."""
    target = target_factory()
    with TransferEngine(TransferConfig(protocol="tcp", timeout_s=1.0)) as eng:
        local = _local(eng, 1 << 20, seed=2)
        eng.write(target.segment, local.ctypes.data, target.plain, 4096)  # connect while alive
        with target.stopped():
            start = time.monotonic()
            statuses = eng.transfer_sync([TransferRequest(OpCode.READ, local.ctypes.data, 1 << 20,
                                                          target.segment, target.plain)], timeout_s=10)
            assert statuses[0].state == RequestState.FAILED
            assert time.monotonic() - start < 5


def test_asyncio_variants(engine: TransferEngine, target: Target, transport: str) -> None:
    local = _local(engine, 1 << 20, seed=11)
    base = remote_base(target, transport)

    async def scenario() -> None:
        await engine.async_write(target.segment, [(local.ctypes.data, base, 1 << 20)])
        back = engine.allocate_managed(1 << 20).numpy()
        await engine.async_read(target.segment, [(back.ctypes.data, base, 1 << 20)])
        assert sha(back) == sha(local)
        with pytest.raises(TransferError):
            await engine.async_write(target.segment, [(local.ctypes.data, 8, 16)])

    asyncio.run(scenario())


def test_shm_falls_back_to_tcp_for_unshared_memory(target: Target) -> None:
    with TransferEngine(TransferConfig(protocol="auto")) as eng:
        local = _local(eng, 1 << 20, seed=12)
        eng.write(target.segment, local.ctypes.data, target.plain, 1 << 20)
        assert target.digest(target.plain, 1 << 20) == sha(local)
        assert eng._started_router()._links  # the plain buffer went over tcp


