"""Misuse and hostile input: each fails alone, loses nothing, and leaves the engine working."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

import pytest

from kvpool.errors import KvpoolError
from kvpool.transfer import OpCode, RequestState, TransferConfig, TransferEngine, TransferRequest
from kvpool.transfer.decoder import NEED_DATA, FrameDecoder, FrameStart
from kvpool.transfer.protocol import FrameType, encode_header
from kvpool.transfer.segment import SegmentDescriptor, ShmRegion, host_identity
from kvpool.transfer.shm import ShmPeer
from tests.support.net import free_port
from tests.transfer.conftest import Target


def test_peer_cannot_point_shm_at_arbitrary_files(tmp_path) -> None:  # type: ignore[no-untyped-def]
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious")
    rel = os.path.relpath(victim, "/dev/shm")
    for name in (rel, f"kvpool-{os.getpid()}-abc-1/../../{rel}", "kvpool-1-abc-1"):
        desc = SegmentDescriptor("x:1", "127.0.0.1", 1, host_identity(), os.getpid(),
                                 (ShmRegion(0x1000, 8, name),))
        assert ShmPeer(desc).resolve(0x1000, 8) is None
    assert victim.read_bytes() == b"precious"


def test_invalid_requests_fail_and_the_worker_survives(target: Target) -> None:
    with TransferEngine(TransferConfig(protocol="tcp", connections_per_peer=1)) as engine:
        local = engine.allocate_managed(4096)
        bad = [TransferRequest(OpCode.WRITE, local.addr, 16, target.segment, -1),
               TransferRequest(OpCode.WRITE, local.addr, 16, target.segment, 1 << 70)]
        batch = engine.allocate_batch(2)
        engine.submit(batch, bad)
        assert [s.state for s in engine.wait(batch, 5)] == [RequestState.FAILED] * 2
        good = TransferRequest(OpCode.WRITE, local.addr, 16, target.segment, target.plain)
        batch = engine.allocate_batch(1)
        engine.submit(batch, [good])  # goes through the (single) worker thread
        assert engine.wait(batch, 5)[0].ok


def test_write_into_a_buffer_the_peer_freed_is_not_done() -> None:
    with TransferEngine(TransferConfig()) as owner, TransferEngine(TransferConfig()) as writer:
        shared = owner.allocate_managed(1 << 16)
        local = writer.allocate_managed(1 << 16)
        assert writer.transfer_sync([TransferRequest(OpCode.WRITE, local.addr, 4096,
                                                     owner.segment_name, shared.addr)])[0].ok
        owner.free_managed(shared)
        after = writer.transfer_sync([TransferRequest(OpCode.WRITE, local.addr, 4096,
                                                      owner.segment_name, shared.addr)])
        assert after[0].state == RequestState.FAILED


@pytest.mark.parametrize("metadata", ["http://127.0.0.1:1/metadata", "redis://127.0.0.1:1"])
def test_failed_start_releases_the_listener(metadata: str) -> None:
    port = free_port()
    before = {t.name for t in threading.enumerate()}
    engine = TransferEngine(TransferConfig(port=port, metadata=metadata))
    with pytest.raises(KvpoolError):  # unreachable directory / unsupported directory
        engine.start()
    assert {t.name for t in threading.enumerate()} - before == set()
    with TransferEngine(TransferConfig(port=port)) as again:  # the port is free again
        assert again.segment_name.endswith(f":{port}")


def test_first_request_after_a_peer_restart_succeeds(target_factory: Callable[..., Target]) -> None:
    port = free_port()
    first = target_factory(port=port)
    with TransferEngine(TransferConfig(protocol="tcp")) as engine:
        local = engine.allocate_managed(4096)
        engine.write(first.segment, local.addr, first.plain, 4096)  # leaves an idle connection
        first.stop()
        revived = target_factory(port=port)
        engine.write(revived.segment, local.addr, revived.plain, 4096)


def test_decoder_passes_reply_frames_through() -> None:
    decoder = FrameDecoder()
    decoder.feed(encode_header(FrameType.WRITE_ACK, 3, 9, 3) + b"\0\0\1")
    start = decoder.next_event()
    assert isinstance(start, FrameStart) and start.addrs == [] and start.header.count == 3
    events = []
    while (event := decoder.next_event()) is not NEED_DATA:
        events.append(event)
    assert [type(e).__name__ for e in events] == ["Data", "FrameEnd"]
