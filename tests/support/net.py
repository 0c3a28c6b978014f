"""Loopback helpers for tests: kvpool's own (kvpool.launch), with the tests' shorter wait."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from kvpool.launch import wait as launch_wait
from kvpool.launch.ports import free_port

__all__ = ["accept_in_threads", "ask", "free_port", "serving_upper", "wait_port"]


def wait_port(port: int, host: str = "127.0.0.1", timeout_s: float = 15.0) -> None:
    """Block until something accepts connections on host:port, or raise TimeoutError."""
    launch_wait.wait_port(port, host, timeout_s)


@contextmanager
def serving_upper() -> Iterator[tuple[str, int]]:
    """A server (threads) that reads each connection to its end (the client's half-close),
    answers the bytes upper-cased and closes: its (host, port)."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve(conn: socket.socket) -> None:
        with conn:
            got = b""
            while data := conn.recv(65536):
                got += data
            conn.sendall(got.upper())

    accept_in_threads(listener, serve)
    try:
        yield listener.getsockname()
    finally:
        listener.close()


def accept_in_threads(listener: socket.socket, serve: Callable[[socket.socket], None]) -> None:
    """Accept on `listener` in a thread of its own, each connection served by `serve` in a
    thread of its own, until the listener is closed."""
    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()
    threading.Thread(target=accept, daemon=True).start()


def ask(port: int, payload: bytes) -> bytes:
    """Send `payload` to 127.0.0.1:`port`, end the sending, and read the answer to its end."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(payload)
        s.shutdown(socket.SHUT_WR)
        out = b""
        while data := s.recv(65536):
            out += data
        return out
