"""Anchors measured beside the store benchmarks, in the same run: what a raw loopback TCP
socket and a plain memcpy do with the same sizes, so a ratio against Mooncake can be read
against the machine's floor.

The raw socket runs between this process and an echo process (blocking sockets, TCP_NODELAY):

    request: [payload_len: u32 LE][reply_len: u32 LE][payload]  ->  reply: reply_len bytes

`raw_round_trips(size)` sends `size` bytes and takes an 8-byte answer (a put's shape; a get's
is the mirror image and costs the same on loopback); `raw_stream(size, batch)` moves batch x size
bytes per request with one small answer. Both return (GB/s, requests/s).
"""

from __future__ import annotations

import socket
import struct
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

from kvpool.bench.common import time_calls

_HEADER = struct.Struct("<II")
_ECHO = r"""
import socket, struct, sys
lst = socket.create_server(("127.0.0.1", 0))
print(lst.getsockname()[1], flush=True)
while True:
    conn, _ = lst.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = bytearray(64 << 20)
    view = memoryview(buf)
    try:
        while True:
            head = conn.recv(8, socket.MSG_WAITALL)
            if len(head) < 8:
                break
            n, reply = struct.unpack("<II", head)
            got = 0
            while got < n:  # a payload larger than the buffer goes round it
                k = conn.recv_into(view[:min(len(view), n - got)])
                if not k:
                    break
                got += k
            if got < n:
                break
            conn.sendall(bytes(reply))
    finally:
        conn.close()
"""


class RawSocket:
    """A connection to the echo process (see the module docstring)."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._buf = bytearray(64 << 20)

    def _request(self, payload: memoryview, reply_len: int) -> None:
        self.sock.sendall(_HEADER.pack(len(payload), reply_len))
        self.sock.sendall(payload)
        self._reply(reply_len)

    def _reply(self, reply_len: int) -> None:
        view, got = memoryview(self._buf), 0
        while got < reply_len:
            k = self.sock.recv_into(view[got:reply_len])
            if not k:
                raise ConnectionError("the raw socket's echo process closed the connection")
            got += k

    def round_trips(self, size: int, count: int, min_s: float = 0.0) -> tuple[float, float]:
        """`count` requests of `size` bytes (more while `min_s` lasts), each answered with
        8 bytes."""
        return self.stream(size, 1, count, min_s)

    def stream(self, size: int, batch: int, count: int,
               min_s: float = 0.0) -> tuple[float, float]:
        """`count` requests of batch x size bytes (more while `min_s` lasts), one small
        answer each."""
        payload = memoryview(bytes(size * batch))
        calls, elapsed = time_calls(lambda: self._request(payload, 8), min_s, count)
        return size * batch * calls / elapsed / 1e9, batch * calls / elapsed

    def close(self) -> None:
        self.sock.close()


@contextmanager
def raw_socket() -> Iterator[RawSocket]:
    """An echo process and a connection to it, both gone on exit."""
    proc = subprocess.Popen([sys.executable, "-c", _ECHO], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        raw = RawSocket(int(proc.stdout.readline()))
        try:
            yield raw
        finally:
            raw.close()
    finally:
        proc.kill()
        proc.wait()


def memcpy(size: int, batch: int, count: int, min_s: float = 0.0) -> tuple[float, float]:
    """numpy copies of batch x size bytes between two buffers (`count`, more while `min_s`
    lasts): (GB/s, objects/s)."""
    src = np.ones(size * batch, np.uint8)
    dst = np.zeros(size * batch, np.uint8)
    calls, elapsed = time_calls(lambda: np.copyto(dst, src), min_s, count)
    return size * batch * calls / elapsed / 1e9, batch * calls / elapsed
