"""Socket driver helpers: exact reads and scatter/gather I/O without intermediate copies."""

from __future__ import annotations

import socket
import time
from typing import Any

from kvpool.errors import PeerUnavailable, RemoteProtocolError
from kvpool.transfer.protocol import (
    CONTROL_TYPES,
    HEADER_BYTES,
    Header,
    decode_control,
    decode_header,
)

IOV_MAX = 1024


def recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    recv_into_views(sock, [memoryview(buf)])
    return buf


def recv_exact_by(sock: socket.socket, n: int, deadline: float) -> bytearray:
    """n bytes, all of them before `deadline` (time.monotonic()); TimeoutError after it, however
    the peer spaces its bytes out."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"deadline passed with {got} of {n} bytes received")
        sock.settimeout(left)
        k = sock.recv_into(view[got:])
        if k == 0:
            raise PeerUnavailable("peer closed the connection mid-frame")
        got += k
    return buf


def recv_into_views(sock: socket.socket, views: list[memoryview]) -> None:
    """Fill every view completely from the socket (scatter read, `recvmsg_into`)."""
    pending = [v for v in views if v.nbytes]
    while pending:
        chunk = pending[:IOV_MAX]
        got = sock.recvmsg_into(chunk)[0]
        if got == 0:
            raise PeerUnavailable("peer closed the connection mid-frame")
        pending = _advance(pending, got)


def send_views(sock: socket.socket, views: list[bytes | bytearray | memoryview]) -> None:
    """Send every view completely (gather write, `sendmsg`)."""
    pending = [memoryview(v) for v in views if len(v)]
    while pending:
        sent = sock.sendmsg(pending[:IOV_MAX])
        pending = _advance(pending, sent)


def _advance(views: list[memoryview], n: int) -> list[memoryview]:
    """Drop the first n bytes from a list of views."""
    i = 0
    while i < len(views) and n >= views[i].nbytes:
        n -= views[i].nbytes
        i += 1
    rest = views[i:]
    if n and rest:
        rest[0] = rest[0][n:]
    return rest


def recv_control(sock: socket.socket, deadline: float) -> tuple[Header, dict[str, Any] | str]:
    """One control frame (handshake or ERROR), whole, before `deadline`."""
    header = decode_header(recv_exact_by(sock, HEADER_BYTES, deadline))
    if header.type not in CONTROL_TYPES:
        raise RemoteProtocolError(f"expected a handshake frame, got {header.type.name}")
    return header, decode_control(header, bytes(recv_exact_by(sock, header.payload_len, deadline)))
