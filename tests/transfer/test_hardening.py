"""Misuse and hostile input: each fails alone, loses nothing, and leaves the engine working."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import pytest

from kvpool.errors import InvalidArgument, KvpoolError
from kvpool.transfer import (
    Buffer,
    OpCode,
    RequestState,
    TransferConfig,
    TransferEngine,
    TransferRequest,
)
from kvpool.transfer.batch import Batch
from kvpool.transfer.decoder import NEED_DATA, Control, FrameDecoder, FrameStart
from kvpool.transfer.protocol import FrameType, Status, encode_header
from kvpool.transfer.segment import SegmentDescriptor, ShmRegion, host_identity
from kvpool.transfer.shm import ShmPeer
from kvpool.transfer.tcp_client import Frame, PeerLink, open_connection
from tests.support.net import free_port
from tests.support.procs import python_env
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


def test_decoder_parses_reply_statuses() -> None:
    decoder = FrameDecoder()
    decoder.feed(encode_header(FrameType.WRITE_ACK, 3, 9, 3) + b"\0\0\1")
    start = decoder.next_event()
    assert isinstance(start, FrameStart) and start.addrs == [] and start.header.count == 3
    assert start.statuses == [Status.OK, Status.OK, Status.OUT_OF_RANGE] and start.payload_bytes == 0
    events = []
    while (event := decoder.next_event()) is not NEED_DATA:
        events.append(event)
    assert [type(e).__name__ for e in events] == ["FrameEnd"]


def test_target_drops_a_peer_that_sends_garbage_after_the_handshake(target: Target) -> None:
    with TransferEngine(TransferConfig(protocol="tcp")) as engine:
        host, port = target.segment.rsplit(":", 1)
        sock, _ = open_connection(host, int(port), engine.config, engine.segment_name)
        with sock:
            sock.sendall(encode_header(FrameType.HELLO, 0, 0, 2) + b"{}")  # not a data frame
            decoder = FrameDecoder()
            decoder.feed(sock.recv(4096))
            event = decoder.next_event()
            assert isinstance(event, Control) and event.header.type == FrameType.ERROR
            assert "unexpected HELLO" in str(event.body)
            assert sock.recv(1) == b""
        local = engine.allocate_managed(4096)
        engine.write(target.segment, local.addr, target.plain, 4096)  # the target still serves


def test_frames_queued_during_close_fail_promptly(target: Target) -> None:
    with TransferEngine(TransferConfig(protocol="tcp", timeout_s=5.0)) as engine:
        local = engine.allocate_managed(4096)
        host, port = target.segment.rsplit(":", 1)
        link = PeerLink(host, int(port), engine.config, engine.segment_name)
        real_queue = link._queue
        closer = threading.Thread(target=link.close)

        class CloseWhileQueueing:
            """Starts a concurrent close() just as send() queues its frame."""

            def put(self, item: object) -> None:
                if item is not None and not closer.is_alive():
                    closer.start()
                    closer.join(0.3)  # on the old code close() ran to the end right here
                real_queue.put(item)

            def get(self) -> object:
                return real_queue.get()

        link._queue = CloseWhileQueueing()  # type: ignore[assignment]
        batch = Batch(1)
        batch.add([1])
        start = time.monotonic()
        link.send([Frame(OpCode.WRITE, batch, [0], [target.plain], [4096], [local.view])])
        assert batch.wait(2.0), "a frame queued during close() waited for the batch timeout"
        assert time.monotonic() - start < 2.0
        closer.join(5)


def test_forced_shm_never_falls_back_to_tcp(target: Target) -> None:
    with TransferEngine(TransferConfig(protocol="shm")) as engine:
        local = engine.allocate_managed(4096)
        statuses = engine.transfer_sync([
            TransferRequest(OpCode.WRITE, local.addr, 4096, target.segment, target.managed),
            TransferRequest(OpCode.WRITE, local.addr, 4096, target.segment, target.plain),
        ])
        assert statuses[0].ok
        assert statuses[1].state == RequestState.FAILED and "'shm' is forced" in (statuses[1].reason or "")
        assert not engine._started_router()._links  # no tcp data connection was made


def test_batch_over_capacity_is_a_kvpool_error() -> None:
    with TransferEngine(TransferConfig()) as engine:
        local = engine.allocate_managed(4096)
        batch = engine.allocate_batch(1)
        request = TransferRequest(OpCode.WRITE, local.addr, 16, engine.segment_name, local.addr + 64)
        with pytest.raises(InvalidArgument, match="capacity"):
            engine.submit(batch, [request, request])


TRUNCATE = """
import os, sys
from kvpool.transfer import OpCode, TransferConfig, TransferEngine, TransferRequest

segment, managed = sys.argv[1], int(sys.argv[2])
for fresh in (False, True):
    with TransferEngine(TransferConfig(protocol="shm")) as engine:
        local = engine.allocate_managed(4096)
        request = TransferRequest(OpCode.WRITE, local.addr, 4096, segment, managed)
        if not fresh:
            assert engine.transfer_sync([request])[0].ok  # maps the peer's file
            name = engine._started_router()._peers.lookup(segment).shm_regions[0].name
            os.truncate(f"/dev/shm/{name}", 0)  # as a buggy or hostile owner could
        status = engine.transfer_sync([request])[0]
        print(status.state.name, status.reason, flush=True)
"""


def test_truncated_shared_file_is_refused_instead_of_sigbus(target: Target) -> None:
    done = subprocess.run([sys.executable, "-c", TRUNCATE, target.segment, str(target.managed)],
                          env=python_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-2000:]}"
    lines = done.stdout.splitlines()
    assert len(lines) == 2 and all(line.startswith("FAILED") and "'shm' is forced" in line for line in lines)


def test_concurrent_first_contacts_share_one_shm_peer(target: Target) -> None:
    for _ in range(3):
        with TransferEngine(TransferConfig()) as engine:
            local = engine.allocate_managed(1 << 16)
            errors: list[str] = []

            def write(k: int, engine: TransferEngine = engine, local: Buffer = local,
                      errors: list[str] = errors) -> None:
                statuses = engine.transfer_sync([TransferRequest(OpCode.WRITE, local.addr + k * 4096, 4096,
                                                                 target.segment, target.managed + k * 4096)])
                errors.extend(s.reason or "" for s in statuses if not s.ok)

            threads = [threading.Thread(target=write, args=(k,)) for k in range(16)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(30)
            assert errors == []
