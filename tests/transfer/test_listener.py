"""The listener under load and abuse: fd exhaustion, slow handshakes, connection floods."""

from __future__ import annotations

import select
import socket
import time
from collections.abc import Callable

import numpy as np
import pytest

from kvpool.transfer import OpCode, TransferConfig, TransferEngine, TransferRequest
from kvpool.transfer.protocol import FrameType, encode_descriptors, encode_header
from kvpool.transfer.tcp_client import open_connection
from tests.transfer.conftest import Target, sha


def _address(target: Target) -> tuple[str, int]:
    host, port = target.segment.rsplit(":", 1)
    return host, int(port)


def _closed_by_peer(sock: socket.socket, within_s: float) -> bool:
    """Whether the peer closes (EOF or reset) `sock` within `within_s`."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    if not poller.poll(within_s * 1000):
        return False
    try:
        return sock.recv(1) == b""
    except OSError:
        return True


def _write_ok(target: Target, timeout_s: float = 3.0) -> bool:
    with TransferEngine(TransferConfig(protocol="tcp", timeout_s=timeout_s)) as engine:
        local = engine.allocate_managed(4096).numpy()
        local[:] = np.arange(4096) % 251
        status = engine.transfer_sync([TransferRequest(OpCode.WRITE, local.ctypes.data, 4096,
                                                       target.segment, target.plain)])[0]
        return status.ok and target.digest(target.plain, 4096) == sha(local)


def test_listener_survives_running_out_of_fds(target: Target) -> None:
    reply = target.command("exhaust")
    assert reply.startswith("ok ")
    waiting = socket.create_connection(_address(target))  # queued; accept() fails with EMFILE
    time.sleep(0.5)
    assert target.command("release") == "ok"
    assert _write_ok(target)
    waiting.close()


def test_slow_handshake_is_dropped_at_the_deadline(target_factory: Callable[..., Target]) -> None:
    target = target_factory(handshake_timeout_s=1.0)
    start = time.monotonic()
    with socket.create_connection(_address(target)) as slow:
        closed = False
        while not closed and time.monotonic() - start < 6:
            try:
                slow.send(b"K")  # one byte of a HELLO header every 0.3 s
            except OSError:
                closed = True
                break
            closed = _closed_by_peer(slow, 0.3)
    assert closed and time.monotonic() - start < 3
    assert _write_ok(target)


def test_connections_per_address_are_capped(target_factory: Callable[..., Target]) -> None:
    """At the limit the connection idle longest gives way: hogs that open connections and
    never finish them cannot lock out the real peers of their address (on one host, all)."""
    target = target_factory(max_connections_per_address=3)
    socks = [socket.create_connection(_address(target)) for _ in range(5)]
    try:
        time.sleep(0.3)
        assert [_closed_by_peer(s, 0.5) for s in socks] == [True, True, False, False, False]
        assert _write_ok(target)                 # formerly refused while the hogs stayed
    finally:
        for sock in socks:
            sock.close()


def test_idle_authenticated_connections_are_closed(target_factory: Callable[..., Target]) -> None:
    target = target_factory(idle_timeout_s=0.5, token="t")
    with TransferEngine(TransferConfig(protocol="tcp", token="t", timeout_s=3.0)) as engine:
        host, port = _address(target)
        sock, _ = open_connection(host, port, engine.config, engine.segment_name)
        with sock:
            assert not _closed_by_peer(sock, 0.2)
            assert _closed_by_peer(sock, 2.0)
        local = engine.allocate_managed(4096)
        engine.write(target.segment, local.addr, target.plain, 4096)
        time.sleep(1.0)  # the pooled connection is closed by the target meanwhile
        engine.write(target.segment, local.addr, target.plain, 4096)


@pytest.mark.parametrize("size, where", [(256 << 10, "registered"), (1 << 34, "anywhere")])
def test_a_trickled_write_frame_is_cut_off(target_factory: Callable[..., Target], size: int,
                                           where: str) -> None:
    """A peer that sends a write's payload one byte at a time, each just inside the read
    timeout, formerly held the admitted write (and the region's fence) for as long as it
    liked; now the payload must keep arriving at 1 MiB/s after timeout_s, counted on what
    arrived: announcing 16 GiB (into an unregistered address: discarded as it comes) buys
    no more time than 256 KiB."""
    target = target_factory(timeout_s=0.5)
    with TransferEngine(TransferConfig(protocol="tcp")) as engine:
        host, port = _address(target)
        sock, _ = open_connection(host, port, engine.config, engine.segment_name)
        with sock:
            addr = target.plain if where == "registered" else 0x1000
            sock.sendall(encode_header(FrameType.WRITE, 1, 1, size)
                         + encode_descriptors([addr], [size], [0]))
            start, closed = time.monotonic(), False
            while not closed and time.monotonic() - start < 6:
                try:
                    sock.send(b"x")
                except OSError:
                    break
                closed = _closed_by_peer(sock, 0.3)
            assert closed and time.monotonic() - start < 3
    assert _write_ok(target)
