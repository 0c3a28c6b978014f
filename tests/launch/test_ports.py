"""Ports for children (kvpool.launch.ports): free ones below the ephemeral range, never the
same twice in one process, and a taken port named by its flag before anything starts."""

from __future__ import annotations

import socket

import pytest

from kvpool.errors import KvpoolError
from kvpool.launch.ports import PICK_SPAN, _ephemeral_low, check_ports, free_port


def test_free_ports_lie_below_the_ephemeral_range_and_are_free() -> None:
    low = _ephemeral_low()
    ports = [free_port() for _ in range(50)]
    assert all(max(1024, low - PICK_SPAN) <= p < low for p in ports)
    assert len(set(ports)) > 40                      # picked at random, not in sequence
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports[0]))           # and nothing held on to it


def test_free_port_never_hands_out_a_port_twice_in_one_process() -> None:
    """A launcher picks every child's port before any child binds one."""
    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)


def test_a_port_in_use_is_named_by_its_flag() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(KvpoolError, match=rf"127.0.0.1:{port} is in use .* --rpc-port"):
            check_ports("127.0.0.1", {"--admin-port": 0, "--rpc-port": port})
    check_ports("127.0.0.1", {"--rpc-port": port})   # free again: no error
