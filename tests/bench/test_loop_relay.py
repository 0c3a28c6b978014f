"""The bare Python relay of `kvpool bench proxy --py-relay` (kvpool.bench.loop_relay), as a
real child process in front of a real server: bytes both ways unchanged, a half-close passed
on, an upstream that refuses closes the client's connection."""

from __future__ import annotations

import socket

from kvpool.bench.loop_relay import running_loop_relay
from kvpool.launch.ports import free_port
from tests.support.net import ask, serving_upper


def test_bytes_go_both_ways_and_a_half_close_is_passed_on() -> None:
    """A server that answers what it read, upper-cased, once its client has ended its
    sending (a half-close): through the relay, each connection gets its own answer."""
    payload = bytes(range(256)) * 4096  # 1 MiB: more than one read and one write
    with serving_upper() as (_, upstream), running_loop_relay(upstream) as (port, pid):
        assert pid > 0
        assert ask(port, payload) == payload.upper()
        assert ask(port, b"again") == b"AGAIN"  # a connection each, the relay goes on


def test_an_upstream_that_refuses_closes_the_clients_connection() -> None:
    dead = free_port()
    with running_loop_relay(dead) as (port, _):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(b"anyone?")
            try:
                assert s.recv(16) == b""
            except ConnectionResetError:
                pass
