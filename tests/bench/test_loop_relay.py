"""The bare Python relay of `kvpool bench proxy --py-relay` (kvpool.bench.loop_relay), as a
real child process in front of a real server: bytes both ways unchanged, a half-close passed
on, an upstream that refuses closes the client's connection."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest

from kvpool.bench.loop_relay import running_loop_relay
from kvpool.launch.ports import free_port


@pytest.fixture
def upstream() -> Iterator[int]:
    """A server that answers each connection with what it read, reversed, once the client
    has ended its sending (a half-close), then closes."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                got = b""
                while data := conn.recv(1 << 16):
                    got += data
                conn.sendall(got[::-1])

    threading.Thread(target=serve, daemon=True).start()
    yield port
    listener.close()


def _ask(port: int, payload: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(payload)
        s.shutdown(socket.SHUT_WR)
        out = b""
        while data := s.recv(1 << 16):
            out += data
        return out


def test_bytes_go_both_ways_and_a_half_close_is_passed_on(upstream: int) -> None:
    payload = bytes(range(256)) * 4096  # 1 MiB: more than one read and one write
    with running_loop_relay(upstream) as (port, pid):
        assert pid > 0
        assert _ask(port, payload) == payload[::-1]
        assert _ask(port, b"again") == b"niaga"  # a connection each, the relay goes on


def test_an_upstream_that_refuses_closes_the_clients_connection() -> None:
    dead = free_port()
    with running_loop_relay(dead) as (port, _):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(b"anyone?")
            try:
                assert s.recv(16) == b""
            except ConnectionResetError:
                pass
