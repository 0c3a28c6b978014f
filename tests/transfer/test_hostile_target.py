"""The initiator against a target that answers wrongly, on real sockets: a fake target that
speaks the wire protocol and trickles a read's payload, or hands out another segment's
descriptor; and a real target stopped (SIGSTOP) under an async transfer."""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import pytest

from kvpool.transfer import OpCode, TransferConfig, TransferEngine, TransferRequest
from kvpool.transfer.protocol import (
    DESCRIPTOR_BYTES,
    HEADER_BYTES,
    FrameType,
    Status,
    decode_header,
    encode_control,
    encode_header,
)
from tests.support.net import accept_in_threads
from tests.transfer.conftest import Target

Answer = Callable[[socket.socket, int, int], None]
"""(connection, request id, bytes asked) -> sends a reply to a READ."""


def _exact(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        more = conn.recv(n - len(data))
        if not more:
            raise EOFError
        data += more
    return data


@contextmanager
def fake_target(answer: Answer, descriptor: dict[str, object] | None = None
                ) -> Iterator[str]:
    """A target on loopback that says HELLO_OK with `descriptor` (its own by default) and
    answers every READ with `answer`; yields its segment name."""
    listener = socket.create_server(("127.0.0.1", 0))
    name = f"127.0.0.1:{listener.getsockname()[1]}"

    def serve(conn: socket.socket) -> None:
        with conn:
            try:
                hello = decode_header(_exact(conn, HEADER_BYTES))
                _exact(conn, hello.payload_len)
                conn.sendall(encode_control(FrameType.HELLO_OK, descriptor or {
                    "name": name, "host": "127.0.0.1", "port": int(name.split(":")[1]),
                    "host_id": "elsewhere", "pid": 1, "shm": []}))
                while True:
                    head = decode_header(_exact(conn, HEADER_BYTES))
                    raw = _exact(conn, head.count * DESCRIPTOR_BYTES)
                    asked = sum(struct.unpack_from("<QQQ", raw, DESCRIPTOR_BYTES * i)[1]
                                for i in range(head.count))
                    answer(conn, head.request_id, asked)
            except (EOFError, OSError):
                pass

    accept_in_threads(listener, serve)
    try:
        yield name
    finally:
        listener.close()


def trickle(conn: socket.socket, rid: int, asked: int) -> None:
    """A READ_RESP whose payload comes a byte every 0.3 s."""
    conn.sendall(encode_header(FrameType.READ_RESP, 1, rid, 1 + asked) + bytes([Status.OK]))
    for _ in range(asked):
        conn.sendall(b"x")
        time.sleep(0.3)


def test_a_read_whose_reply_trickles_fails_instead_of_hanging() -> None:
    """Each byte comes within the read timeout, so only a pace over the whole payload ends
    it: the read fails after about timeout_s, not after the hour its 4 KiB would take."""
    with fake_target(trickle) as name, \
            TransferEngine(TransferConfig(protocol="tcp", timeout_s=1.0)) as engine:
        local = np.zeros(4096, np.uint8)
        engine.register(local)
        done: list[object] = []
        worker = threading.Thread(target=lambda: done.extend(engine.transfer_sync(
            [TransferRequest(OpCode.READ, local.ctypes.data, 4096, name, 0x1000)])),
            daemon=True)
        started = time.monotonic()
        worker.start()
        worker.join(10)
        assert not worker.is_alive(), "the read is still waiting on a trickle"
        assert time.monotonic() - started < 6
        assert len(done) == 1 and not done[0].ok  # type: ignore[attr-defined]


def test_a_descriptor_for_another_segment_is_refused(target_factory: Callable[..., Target]
                                                     ) -> None:
    """A peer answers the handshake with another segment's descriptor (the real target's):
    the initiator must not send the transfer there and report it done."""
    real = target_factory()
    real.fill(real.plain, 16, seed=3)
    before = real.digest(real.plain, 16)
    host, port = real.segment.rsplit(":", 1)
    forged = {"name": real.segment, "host": host, "port": int(port), "host_id": "elsewhere",
              "pid": 1, "shm": []}
    with fake_target(trickle, forged) as name, \
            TransferEngine(TransferConfig(protocol="tcp", timeout_s=2.0)) as engine:
        src = np.full(16, 0x77, np.uint8)
        engine.register(src)
        (status,) = engine.transfer_sync(
            [TransferRequest(OpCode.WRITE, src.ctypes.data, 16, name, real.plain)])
        assert not status.ok and "describes" in (status.reason or "")
    assert real.digest(real.plain, 16) == before


@pytest.mark.parametrize("call", ["sync", "async"])
def test_a_failed_transfer_lands_no_byte_after_it_returns(
        target_factory: Callable[..., Target], call: str) -> None:
    """A 4 MiB read goes as several slices; the peer stops (SIGSTOP), one slice times out
    and fails the request while the others still wait on their connections. Once the call
    has returned the failure, the peer resuming lands nothing in the caller's memory."""
    target = target_factory()
    size = 4 << 20
    with TransferEngine(TransferConfig(protocol="tcp", timeout_s=0.5)) as engine:
        dst = np.zeros(size, np.uint8)
        engine.register(dst)
        engine.read(target.segment, dst.ctypes.data, target.plain, 4096)   # connected
        with target.stopped():
            requests = [TransferRequest(OpCode.READ, dst.ctypes.data, size, target.segment,
                                        target.plain)]
            statuses = asyncio.run(engine.async_transfer(requests)) if call == "async" \
                else engine.transfer_sync(requests)
            assert not statuses[0].ok
            dst[:] = 0x11                                  # the memory is the caller's again
        time.sleep(1.0)
        assert int(np.count_nonzero(dst != 0x11)) == 0
