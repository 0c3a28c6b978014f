"""Ports on this host: one free for a child to bind (`free_port`), and a check that the ports a
launcher was told to use can be bound (`check_ports`)."""

from __future__ import annotations

import errno
import random
import socket
from pathlib import Path

from kvpool.errors import KvpoolError

_PICK = random.SystemRandom()  # forked processes must not pick the same sequence
_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_HANDED_OUT: set[int] = set()
"""Ports free_port returned in this process."""
PICK_SPAN = 8192
"""free_port picks among this many ports just below the kernel's ephemeral range."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing is bound to right now, picked at random just below the kernel's
    ephemeral range: every outgoing connection takes its local port from that range, so a
    port picked inside it can be taken by one before the caller binds it (seen in the test
    suite as EADDRINUSE). Another process calling free_port still can take it, with odds of
    about one in PICK_SPAN; this process never gets the same port twice (a launcher picks
    every child's port before any child binds it)."""
    low = _ephemeral_low()
    for _ in range(64):
        port = _PICK.randrange(max(1024, low - PICK_SPAN), low)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            _HANDED_OUT.add(port)
            return port
    with socket.socket() as sock:  # that span is crowded: any port the kernel gives
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def check_ports(host: str, ports: dict[str, int]) -> None:
    """KvpoolError naming the first of `ports` (flag -> port; 0 = any) that cannot be bound on
    `host`: taken by another server (another cluster, whose servers would answer this one's
    readiness checks), or a host this machine does not have."""
    for flag, port in ports.items():
        if not port:
            continue
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
            except OSError as exc:
                why = exc.strerror or str(exc)
                if exc.errno == errno.EADDRINUSE:
                    raise KvpoolError(f"{host}:{port} is in use ({why}): is another kvpool up "
                                      f"running? Stop it, or choose another port with {flag}"
                                      ) from exc
                raise KvpoolError(f"cannot listen on {host}:{port} ({why}): check --host "
                                  f"and {flag}") from exc


def _ephemeral_low() -> int:
    try:
        return int(_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default
