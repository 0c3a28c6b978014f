"""Socket driver helpers: exact reads and scatter/gather I/O without intermediate copies."""

from __future__ import annotations

import socket

from kvpool.errors import PeerUnavailable

IOV_MAX = 1024


def recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    recv_into_views(sock, [memoryview(buf)])
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
