"""A misbehaving peer on a real socket: it answers fixed bytes, or nothing at all."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def raw_server(reply: bytes | None) -> Iterator[int]:
    """Listen on a free loopback port; for each request send `reply` (None: stay silent).

    Yields the port. Connections are held open until the context exits.
    """
    listener = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    stopping = threading.Event()

    def serve() -> None:
        listener.settimeout(0.05)
        while not stopping.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            held.append(conn)
            if reply is not None:
                conn.settimeout(2.0)
                _read_head(conn)
                conn.sendall(reply)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield int(listener.getsockname()[1])
    finally:
        stopping.set()
        thread.join(5)
        for conn in held:
            conn.close()
        listener.close()


def _read_head(conn: socket.socket) -> None:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return
        data += chunk
