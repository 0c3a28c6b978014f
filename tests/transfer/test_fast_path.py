"""The fast paths without a batch (Router.run_one for one request, Router.run_frame for one
frame) and the frame reader they drive: the bytes served
must be the bytes registered, and fences and unregistered ranges are refused as on the batch
path, leaving the local buffer untouched."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from kvpool.transfer import OpCode, RequestState, TransferConfig, TransferEngine, TransferRequest
from kvpool.transfer.decoder import FrameEnd, FrameStart
from kvpool.transfer.protocol import FENCED_REASON, FrameType, encode_descriptors, encode_header
from kvpool.transfer.routing import Router
from kvpool.transfer.segment import SegmentDescriptor
from kvpool.transfer.wire import SCRATCH_BYTES, FrameReader
from tests.transfer.conftest import Target, remote_base, sha


def _refuse(*args: object, **kwargs: object) -> None:
    raise AssertionError("a request took the batch path")


def _pattern(engine: TransferEngine, size: int, seed: int) -> np.ndarray:
    buf = engine.allocate_managed(size).numpy()
    buf[:] = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)
    return buf


def _one(engine: TransferEngine, op: OpCode, local: np.ndarray, target: Target, addr: int,
         size: int, fence: int = 0) -> tuple[RequestState, str | None]:
    status = engine.transfer_sync([TransferRequest(op, local.ctypes.data, size, target.segment,
                                                   addr, fence)])[0]
    return status.state, status.reason


@pytest.mark.parametrize("size", [1, 4096, SCRATCH_BYTES + 1, TransferConfig().slice_bytes])
def test_single_requests_move_the_right_bytes(engine: TransferEngine, target: Target, transport: str,
                                              size: int) -> None:
    base = remote_base(target, transport)
    local = _pattern(engine, size, seed=size)
    engine.write(target.segment, local.ctypes.data, base, size)  # first contact: batch path
    assert target.digest(base, size) == sha(local)
    target.fill(base, size, seed=size + 1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Router, "dispatch", _refuse)
        back = engine.allocate_managed(size).numpy()
        assert _one(engine, OpCode.READ, back, target, base, size) == (RequestState.DONE, None)
        assert sha(back) == target.digest(base, size)
        assert _one(engine, OpCode.WRITE, local, target, base, size) == (RequestState.DONE, None)
    assert target.digest(base, size) == sha(local)


def test_fast_path_refuses_a_stale_fence_and_touches_nothing(engine: TransferEngine, target: Target,
                                                             transport: str) -> None:
    base = remote_base(target, transport)
    local = _pattern(engine, 4096, seed=1)
    engine.write(target.segment, local.ctypes.data, base, 4096)  # cache the peer
    target.set_fence(base, 7)
    back = engine.allocate_managed(4096).numpy()
    back[:] = 0xAB
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Router, "dispatch", _refuse)
        assert _one(engine, OpCode.READ, back, target, base, 4096, fence=6) == \
            (RequestState.FAILED, FENCED_REASON)
        assert (back == 0xAB).all()
        other = _pattern(engine, 4096, seed=2)
        assert _one(engine, OpCode.WRITE, other, target, base, 4096, fence=6) == \
            (RequestState.FAILED, FENCED_REASON)
        assert target.digest(base, 4096) == sha(local)
        assert _one(engine, OpCode.READ, back, target, base, 4096, fence=7)[0] == RequestState.DONE
    assert sha(back) == sha(local)


def test_fast_path_refuses_unregistered_target_ranges(engine: TransferEngine, target: Target,
                                                      transport: str) -> None:
    base = remote_base(target, transport)
    local = _pattern(engine, 4096, seed=3)
    engine.write(target.segment, local.ctypes.data, base, 4096)
    back = engine.allocate_managed(4096).numpy()
    back[:] = 0xCD
    beyond = base + target.size - 100  # runs past the end of the registered buffer
    for op, buf in ((OpCode.READ, back), (OpCode.WRITE, local)):
        state, reason = _one(engine, op, buf, target, beyond, 4096)
        assert state == RequestState.FAILED and reason
    assert (back == 0xCD).all()


def test_large_requests_go_through_shm_whole_and_over_tcp_in_slices(engine: TransferEngine,
                                                                    target: Target, transport: str) -> None:
    size = 3 * TransferConfig().slice_bytes + 4096
    base = remote_base(target, transport)
    local = _pattern(engine, size, seed=9)
    engine.write(target.segment, local.ctypes.data, base, 16)  # cache the peer
    calls: list[int] = []
    dispatch = Router.dispatch

    def counted(self: Router, batch: object, requests: list[TransferRequest], inline: bool = False) -> None:
        calls.append(len(requests))
        dispatch(self, batch, requests, inline)  # type: ignore[arg-type]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Router, "dispatch", counted)
        assert _one(engine, OpCode.WRITE, local, target, base, size) == (RequestState.DONE, None)
    assert target.digest(base, size) == sha(local)
    assert calls == ([1] if transport == "tcp" else [])


def test_unregistered_local_memory_is_refused(engine: TransferEngine, target: Target,
                                              transport: str) -> None:
    stray = np.zeros(4096, dtype=np.uint8)  # never registered
    engine.write(target.segment, _pattern(engine, 16, 4).ctypes.data, remote_base(target, transport), 16)
    state, reason = _one(engine, OpCode.READ, stray, target, remote_base(target, transport), 4096)
    assert state == RequestState.FAILED and "not registered" in (reason or "")


def test_small_frame_with_refused_descriptors_fills_only_the_ok_views(engine: TransferEngine,
                                                                      target: Target,
                                                                      transport: str) -> None:
    """One frame, read in one recv, whose reply carries fewer payload bytes than asked."""
    base = target.plain
    engine.write(target.segment, _pattern(engine, 16, 6).ctypes.data, base, 16)  # cache the peer
    target.fill(base, 8 << 10, seed=5)
    target.set_fence(base, 3)
    back = engine.allocate_managed(8 << 10).numpy()
    back[:] = 0xEE
    reqs = [TransferRequest(OpCode.READ, back.ctypes.data + i * 1024, 1024, target.segment,
                            base + i * 1024, 3 if i % 2 else 2) for i in range(8)]
    with pytest.MonkeyPatch.context() as patch:
        if transport == "tcp":  # one frame to one peer: Router.run_frame
            patch.setattr(Router, "dispatch", _refuse)
        statuses = engine.transfer_sync(reqs)
    assert [s.ok for s in statuses] == [False, True] * 4
    assert {s.reason for s in statuses[::2]} == {FENCED_REASON}
    for i in range(8):
        chunk = back[i * 1024 : (i + 1) * 1024]
        if i % 2:
            assert sha(chunk) == target.digest(base + i * 1024, 1024)
        else:
            assert (chunk == 0xEE).all()


def _batch(op: OpCode, local: np.ndarray, target: Target, base: int, size: int,
           count: int) -> list[TransferRequest]:
    return [TransferRequest(op, local.ctypes.data + i * size, size, target.segment,
                            base + i * size) for i in range(count)]


@pytest.mark.parametrize("size", [4096, 64 << 10])
def test_a_batch_to_one_peer_runs_as_one_frame_and_reports_every_request(
        engine: TransferEngine, target: Target, transport: str, size: int) -> None:
    """Router.run_frame: no Batch, the same bytes, every hook called as the batch path does."""
    count, base = 32, remote_base(target, transport)
    local = _pattern(engine, size * count, seed=size)
    engine.write(target.segment, local.ctypes.data, base, 16)  # first contact: caches the peer
    sent: list[int] = []
    done: list[int] = []
    with pytest.MonkeyPatch.context() as patch:
        if transport == "tcp":  # a same-host peer's shared buffer is copied over shm instead
            patch.setattr(Router, "dispatch", _refuse)
        statuses = engine.transfer_sync(_batch(OpCode.WRITE, local, target, base, size, count),
                                        on_done=done.append, on_sent=sent.append)
        assert [s.state for s in statuses] == [RequestState.DONE] * count
        assert target.digest(base, size * count) == sha(local)
        back = engine.allocate_managed(size * count).numpy()
        statuses = engine.transfer_sync(_batch(OpCode.READ, back, target, base, size, count),
                                        on_done=done.append, on_sent=sent.append)
    assert [s.state for s in statuses] == [RequestState.DONE] * count
    assert sha(back) == sha(local)
    assert sorted(done) == sorted(list(range(count)) * 2)
    if transport == "tcp":  # every write when its frame was in the socket; a large read's too
        assert sent[:count] == list(range(count))
        assert sent[count:] == (list(range(count)) if size * count > SCRATCH_BYTES else [])


def test_a_frame_with_an_unregistered_local_range_takes_the_batch_path(
        engine: TransferEngine, target: Target) -> None:
    """One bad request: reported in the batch path's words, the others still move."""
    local = _pattern(engine, 4 * 4096, seed=7)
    engine.write(target.segment, local.ctypes.data, target.plain, 16)
    stray = np.zeros(4096, dtype=np.uint8)  # never registered
    reqs = _batch(OpCode.READ, local, target, target.plain, 4096, 4)
    reqs[2] = reqs[2]._replace(local_addr=stray.ctypes.data)
    statuses = engine.transfer_sync(reqs)
    assert [s.ok for s in statuses] == [True, True, False, True]
    assert "not registered" in (statuses[2].reason or "")


def test_a_read_into_a_read_only_range_inside_a_writable_buffer_is_refused(
        engine: TransferEngine, target: Target) -> None:
    """Overlapping registrations: the innermost buffer's read-only flag holds on every path,
    whatever buffer was found before."""
    whole = _pattern(engine, 4 * 4096, seed=10)
    outer = engine.register(whole)
    engine.register(memoryview(whole[8192:12288]).toreadonly())
    engine.write(target.segment, outer.addr, target.plain, 16)
    target.fill(target.plain, 4096, seed=11)
    protected = sha(whole[8192:12288])
    for count in (1, 2):  # one request (run_one), then a frame of two (run_frame)
        reqs = [TransferRequest(OpCode.READ, outer.addr + i * 4096, 4096, target.segment,
                                target.plain) for i in range(count)]
        reqs[-1] = reqs[-1]._replace(local_addr=outer.addr + 8192)
        statuses = engine.transfer_sync(reqs)
        assert "read-only" in (statuses[-1].reason or "")
        assert sha(whole[8192:12288]) == protected


def test_the_target_checks_an_inner_region_for_itself(engine: TransferEngine,
                                                     target: Target) -> None:
    """Regions registered inside a larger buffer at the target: a read-only one refuses
    writes and a fenced one a stale fence, in a frame whose first descriptor went to the
    outer buffer."""
    base = target.plain
    ro, fenced = base + 8192, base + 16384
    assert target.command(f"nest {ro} 4096 0 1") == "ok"
    assert target.command(f"nest {fenced} 4096 5 0") == "ok"
    engine.write(target.segment, _pattern(engine, 16, 14).ctypes.data, base, 16)
    target.fill(base, 32768, seed=12)
    kept = [target.digest(ro, 4096), target.digest(fenced, 4096)]
    local = _pattern(engine, 3 * 4096, seed=13)
    writes = [TransferRequest(OpCode.WRITE, local.ctypes.data + i * 4096, 4096, target.segment,
                              addr) for i, addr in enumerate((base, ro, fenced))]
    statuses = engine.transfer_sync(writes)
    assert statuses[0].ok
    assert "read-only" in (statuses[1].reason or "")
    assert statuses[2].reason == FENCED_REASON
    assert [target.digest(ro, 4096), target.digest(fenced, 4096)] == kept
    back = engine.allocate_managed(2 * 4096).numpy()
    reads = [TransferRequest(OpCode.READ, back.ctypes.data, 4096, target.segment, base),
             TransferRequest(OpCode.READ, back.ctypes.data + 4096, 4096, target.segment, fenced)]
    assert engine.transfer_sync(reads)[1].reason == FENCED_REASON
    assert all(s.ok for s in engine.transfer_sync([reads[0], reads[1]._replace(fence=5)]))


def test_forced_shm_to_another_host_never_sends_a_frame(target: Target) -> None:
    """With protocol 'shm' a peer on another host is refused, not reached over tcp."""
    with TransferEngine(TransferConfig(protocol="shm")) as eng, pytest.MonkeyPatch.context() as patch:
        local = eng.allocate_managed(2 * 4096)
        assert eng.transfer_sync([TransferRequest(OpCode.WRITE, local.addr, 16, target.segment,
                                                  target.managed)])[0].ok  # caches the peer
        patch.setattr(SegmentDescriptor, "same_host", lambda self: False)
        reqs = [TransferRequest(OpCode.WRITE, local.addr + i * 4096, 4096, target.segment,
                                target.plain + i * 4096) for i in range(2)]
        statuses = eng.transfer_sync(reqs)
        assert all("'shm' is forced" in (s.reason or "") for s in statuses)
        assert not eng._started_router()._links  # no tcp data connection was made


def test_a_request_field_of_the_wrong_type_fails_its_requests_and_raises_nothing(
        engine: TransferEngine, target: Target) -> None:
    local = _pattern(engine, 2 * 4096, seed=8)
    engine.write(target.segment, local.ctypes.data, target.plain, 16)
    reqs = _batch(OpCode.WRITE, local, target, target.plain, 4096, 2)
    reqs[1] = reqs[1]._replace(fence=None)  # type: ignore[arg-type]
    statuses = engine.transfer_sync(reqs)
    assert [s.state for s in statuses] == [RequestState.FAILED] * 2


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    yield a, b
    a.close()
    b.close()


def _write_frame(payload: bytes, rid: int = 1) -> bytes:
    return (encode_header(FrameType.WRITE, 1, rid, len(payload))
            + encode_descriptors([0x1000], [len(payload)]) + payload)


@pytest.mark.parametrize("size", [0, 10, SCRATCH_BYTES, 3 * SCRATCH_BYTES + 7])
def test_reader_moves_a_payload_into_views(pair: tuple[socket.socket, socket.socket], size: int) -> None:
    a, b = pair
    payload = bytes(np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8))
    sender = threading.Thread(target=a.sendall, args=(_write_frame(payload) + _write_frame(b"xy", 2),))
    sender.start()
    reader = FrameReader(b, 5.0, None)
    start = reader.next_event(SCRATCH_BYTES)
    assert isinstance(start, FrameStart) and start.lengths == [size]
    halves = [memoryview(bytearray(size // 2)), memoryview(bytearray(size - size // 2))]
    assert isinstance(reader.finish_frame(halves), FrameEnd)
    assert b"".join(bytes(h) for h in halves) == payload
    second = reader.next_event(SCRATCH_BYTES)  # may already be buffered by the greedy read
    assert isinstance(second, FrameStart) and second.header.request_id == 2
    tail = memoryview(bytearray(2))
    reader.finish_frame([tail])
    assert bytes(tail) == b"xy"
    sender.join()


def test_reader_never_reads_past_the_bytes_it_may_take(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    frame = _write_frame(b"abc")
    a.sendall(frame + b"NEXT")
    reader = FrameReader(b, 5.0, None)
    start = reader.next_event(len(frame))
    assert isinstance(start, FrameStart)
    out = memoryview(bytearray(3))
    reader.finish_frame([out])
    assert bytes(out) == b"abc"
    assert b.recv(16) == b"NEXT"


def test_kernel_timeouts_tell_idle_from_a_stalled_frame(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    reader = FrameReader(b, 0.2, None)  # idle for ever, 0.2 s inside a frame (ticks of 0.2 s)
    threading.Timer(0.5, a.sendall, args=(_write_frame(b"z" * 10)[:-4],)).start()
    start = reader.next_event(SCRATCH_BYTES)  # waited 2 ticks between frames: fine
    assert isinstance(start, FrameStart)
    began = time.monotonic()
    with pytest.raises(TimeoutError):
        reader.finish_frame([memoryview(bytearray(10))])  # 4 bytes never come
    assert 0.15 < time.monotonic() - began < 1.0
    idle = FrameReader(a, 1.0, 0.1)
    began = time.monotonic()
    with pytest.raises(TimeoutError):
        idle.next_event()
    assert time.monotonic() - began < 0.5


@pytest.mark.parametrize("count,size", [(1, 4096), (8, 4096), (3, (2 << 20) + 4096)])
def test_on_done_reports_each_request_that_succeeded_before_transfer_sync_returns(
        engine: TransferEngine, target: Target, transport: str, count: int, size: int) -> None:
    base = remote_base(target, transport)
    local = _pattern(engine, count * size, seed=7)
    engine.write(target.segment, local.ctypes.data, base, size)  # cache the peer
    target.set_fence(base, 7)
    requests = [TransferRequest(OpCode.WRITE, local.ctypes.data + i * size, size,
                                target.segment, base + i * size, 7) for i in range(count)]
    requests.append(TransferRequest(OpCode.WRITE, local.ctypes.data, size, target.segment,
                                    base, fence=6))  # a stale fence: fails, not reported
    seen: list[tuple[int, str]] = []
    one_command = threading.Lock()  # hooks run on several threads; the target's pipe is one

    def landed(i: int) -> None:
        with one_command:
            seen.append((i, target.digest(base + i * size, size)))
    statuses = engine.transfer_sync(requests, on_done=landed)
    assert [s.ok for s in statuses] == [True] * count + [False]
    assert sorted(i for i, _ in seen) == list(range(count))  # each once, the failure never
    for i, digest in seen:  # the bytes had landed when it was told
        assert digest == sha(local[i * size:(i + 1) * size])


def test_a_failing_on_done_hook_is_logged_and_the_transfer_still_succeeds(
        engine: TransferEngine, target: Target, transport: str) -> None:
    base = remote_base(target, transport)
    local = _pattern(engine, 2 * 4096, seed=8)
    requests = [TransferRequest(OpCode.WRITE, local.ctypes.data + i * 4096, 4096,
                                target.segment, base + i * 4096) for i in range(2)]

    def broken(index: int) -> None:
        raise RuntimeError("hook bug")
    assert all(s.ok for s in engine.transfer_sync(requests, on_done=broken))
    assert target.digest(base, 2 * 4096) == sha(local)


def test_on_sent_reports_each_tcp_write_before_its_answer(target: Target) -> None:
    with TransferEngine(TransferConfig(protocol="tcp", timeout_s=5.0)) as engine:
        size, count = 4096, 8
        local = _pattern(engine, count * size, seed=9)
        requests = [TransferRequest(OpCode.WRITE, local.ctypes.data + i * size, size,
                                    target.segment, target.plain + i * size)
                    for i in range(count)]
        events: list[tuple[str, int]] = []
        statuses = engine.transfer_sync(requests, on_done=lambda i: events.append(("done", i)),
                                        on_sent=lambda i: events.append(("sent", i)))
        assert all(s.ok for s in statuses)
        assert target.digest(target.plain, count * size) == sha(local)
        for i in range(count):  # each sent once, and told before its answer came
            assert events.count(("sent", i)) == 1
            assert events.index(("sent", i)) < events.index(("done", i))
        reads = [TransferRequest(OpCode.READ, r.local_addr, size, r.target, r.target_addr)
                 for r in requests[:2]]  # a frame within the reader's scratch: one read
        events.clear()
        assert all(s.ok for s in engine.transfer_sync(
            reads, on_done=lambda i: events.append(("done", i)),
            on_sent=lambda i: events.append(("sent", i))))
        assert sorted(events) == [("done", 0), ("done", 1)]  # nothing to tell before the end


def test_on_sent_reports_the_reads_of_a_large_frame_as_their_bytes_arrive(
        target: Target) -> None:
    """A read frame over ARRIVAL_STEP_BYTES comes in steps; each read is told once its bytes
    are in local memory (checked in the hook), before the frame ends and before its done."""
    with TransferEngine(TransferConfig(protocol="tcp", timeout_s=5.0)) as engine:
        size, count = 64 << 10, 32  # 2 MiB in one frame (TransferConfig.small_frame_bytes)
        target.fill(target.plain, size * count, seed=11)
        local = engine.allocate_managed(size * count).numpy()
        local[:] = 0xEE
        reads = [TransferRequest(OpCode.READ, local.ctypes.data + i * size, size,
                                 target.segment, target.plain + i * size) for i in range(count)]
        expected = [target.digest(target.plain + i * size, size) for i in range(count)]
        events: list[tuple[str, int]] = []
        held: list[bool] = []
        last_untouched: list[bool] = []

        def arrived(i: int) -> None:
            events.append(("sent", i))
            held.append(sha(local[i * size:(i + 1) * size]) == expected[i])
            last_untouched.append(bool((local[-size:] == 0xEE).all()))
        statuses = engine.transfer_sync(reads, on_done=lambda i: events.append(("done", i)),
                                        on_sent=arrived)
        assert all(s.ok for s in statuses)
        assert held == [True] * count  # the bytes were all there when told
        for i in range(count):
            assert events.count(("sent", i)) == 1
            assert events.index(("sent", i)) < events.index(("done", i))
        assert last_untouched[0]  # told of the first reads before the last one was read
        assert events.index(("sent", 0)) < min(events.index(("done", i)) for i in range(count))
        assert sha(local) == target.digest(target.plain, size * count)
