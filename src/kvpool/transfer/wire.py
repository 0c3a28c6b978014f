"""Socket driver helpers: feeding the frame decoder, and scatter/gather I/O without copies."""

from __future__ import annotations

import socket
import time

from kvpool.errors import PeerUnavailable, RemoteProtocolError, TransferTimeout
from kvpool.transfer.decoder import NEED_DATA, Control, Event, FrameDecoder, FrameStart

IOV_MAX = 1024


def recv_into_views(sock: socket.socket, views: list[memoryview],
                    deadline: float | None = None) -> None:
    """Fill every view completely from the socket (scatter read, `recvmsg_into`). With a
    `deadline` (time.monotonic()), TransferTimeout once it passed between two reads, so a
    peer trickling bytes just inside the socket timeout cannot stretch a frame forever."""
    pending = [v for v in views if v.nbytes]
    while pending:
        if deadline is not None and time.monotonic() > deadline:
            raise TransferTimeout("frame payload not received in time (too slow a peer)")
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


def receive_event(sock: socket.socket, decoder: FrameDecoder, deadline: float | None = None,
                  frame_timeout_s: float | None = None, idle_timeout_s: float | None = None) -> Event | None:
    """The decoder's next event, reading from `sock` only the bytes it wants (so payloads stay
    in the socket for `recv_into`). None when the peer closed the connection between frames.

    `deadline` (time.monotonic()) bounds the whole call however the peer spaces its bytes
    (TimeoutError after it). Otherwise, with `frame_timeout_s`, a read inside a frame times out
    after that long while between frames the peer may stay silent for `idle_timeout_s` (None:
    for ever); without either the socket's own timeout applies.
    """
    while (event := decoder.next_event()) is NEED_DATA:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("deadline passed before the frame was complete")
            sock.settimeout(left)
        elif frame_timeout_s is not None:
            sock.settimeout(idle_timeout_s if decoder.at_boundary else frame_timeout_s)
        data = sock.recv(decoder.bytes_wanted(), socket.MSG_WAITALL)
        if not data:
            if decoder.at_boundary:
                return None
            raise PeerUnavailable("peer closed the connection mid-frame")
        decoder.receive_data(data)
    return event


def recv_control(sock: socket.socket, deadline: float) -> Control:
    """One whole control frame (handshake or ERROR) before `deadline`."""
    event = receive_event(sock, FrameDecoder(), deadline)
    if event is None:
        raise PeerUnavailable("peer closed the connection during the handshake")
    if not isinstance(event, Control):
        kind = event.header.type.name if isinstance(event, FrameStart) else type(event).__name__
        raise RemoteProtocolError(f"expected a handshake frame, got {kind}")
    return event
