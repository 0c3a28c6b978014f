"""The forwarded port of `kvpool up --hosts` (kvpool.serve.port_forward) over real sockets:
bytes both ways, a half-close passed on, several connections at once, an unreachable server,
and close() ending the connections it relays."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest

from kvpool.serve.port_forward import PortForward
from tests.support.net import ask, serving_upper


@pytest.fixture
def upper_server() -> Iterator[tuple[str, int]]:
    """Reads a connection to its end, answers the bytes upper-cased, closes."""
    with serving_upper() as address:
        yield address


def test_bytes_go_both_ways_with_the_half_close(upper_server: tuple[str, int]) -> None:
    payload = bytes(range(97, 123)) * 40_000  # 1 MiB: many chunks each way
    with PortForward("127.0.0.1", 0, lambda: socket.create_connection(upper_server)) as fwd:
        assert ask(fwd.port, payload) == payload.upper()
        results: list[bytes] = []
        threads = [threading.Thread(target=lambda i=i: results.append(ask(fwd.port, b"c%d" % i)))
                   for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert sorted(results) == sorted(b"C%d" % i for i in range(8))


def test_an_unreachable_server_closes_the_client() -> None:
    def refuse() -> socket.socket:
        raise ConnectionRefusedError(111, "refused")

    with PortForward("127.0.0.1", 0, refuse) as fwd:
        with socket.create_connection(("127.0.0.1", fwd.port), timeout=10) as s:
            try:
                assert s.recv(10) == b""
            except ConnectionResetError:
                pass


def test_close_ends_relayed_connections_and_frees_the_port(
        upper_server: tuple[str, int]) -> None:
    fwd = PortForward("127.0.0.1", 0, lambda: socket.create_connection(upper_server))
    with socket.create_connection(("127.0.0.1", fwd.port), timeout=10) as s:
        s.sendall(b"half a request")
        assert ask(fwd.port, b"x") == b"X"  # (the relay of `s` is up by now)
        fwd.close()
        try:
            assert s.recv(10) == b""
        except ConnectionResetError:
            pass
    with socket.create_server(("127.0.0.1", fwd.port)):
        pass  # the port is free again
    with pytest.raises(OSError):
        with socket.create_server(("127.0.0.1", 0)) as taken:
            PortForward("127.0.0.1", taken.getsockname()[1], lambda: socket.socket())
