"""`TransferEngine.begin_read`: a READ in two steps over tcp, on real sockets against a fake
target that speaks the wire protocol (tests/transfer/test_hostile_target.py)."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

from kvpool.transfer import OpCode, TransferConfig, TransferEngine, TransferRequest
from kvpool.transfer.protocol import FrameType, Status, encode_header
from tests.transfer.test_hostile_target import fake_target, trickle

SIZE = 4096
trickling = {"on": False}


def answer(conn: socket.socket, rid: int, asked: int) -> None:
    """At once, or (while `trickling`) a byte every 0.3 s."""
    if trickling["on"]:
        trickle(conn, rid, asked)
        return
    conn.sendall(encode_header(FrameType.READ_RESP, 1, rid, 1 + asked) + bytes([Status.OK])
                 + b"\x07" * asked)


@contextmanager
def reading() -> Iterator[tuple[TransferEngine, np.ndarray, TransferRequest]]:
    """An engine, its registered buffer and a READ of it from the fake target (answering at
    once), before the first transfer to it."""
    trickling["on"] = False
    with fake_target(answer) as name, \
            TransferEngine(TransferConfig(protocol="tcp", timeout_s=1.0)) as engine:
        local = np.zeros(SIZE, np.uint8)
        engine.register(local)
        yield engine, local, TransferRequest(OpCode.READ, local.ctypes.data, SIZE, name, 0x1000)


def test_a_begun_read_needs_an_idle_connection_and_keeps_it_when_given_up() -> None:
    """No idle connection: nothing begins (no handshake ahead of the caller's other work).
    A reply given up once it is all in is read off, and its connection stays pooled: the
    next read begins on it, and lands."""
    with reading() as (engine, local, req):
        assert engine.begin_read(req) is None                 # the peer is not known yet
        assert engine.transfer_sync([req])[0].ok              # now a connection is pooled
        began = engine.begin_read(req)
        assert began is not None
        time.sleep(0.1)                                       # the reply is in
        began.abandon()
        local[:] = 0
        again = engine.begin_read(req)
        assert again is not None, "the given-up reply's connection was not kept"
        assert again.finish().ok and not again.timed_out and (local == 7).all()
        assert engine.begin_read(req._replace(op=OpCode.WRITE)) is None


def test_a_begun_read_whose_reply_trickles_is_reported_as_timed_out() -> None:
    """A reply that keeps coming, below the pace a payload must keep, ends the read after
    about the timeout, as a node that did not answer in time (`timed_out`), so a caller
    does not wait for that node again."""
    with reading() as (engine, _, req):
        assert engine.transfer_sync([req])[0].ok
        trickling["on"] = True
        began = engine.begin_read(req)
        assert began is not None
        started = time.monotonic()
        assert not began.finish().ok
        assert began.timed_out and time.monotonic() - started < 6
