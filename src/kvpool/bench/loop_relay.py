"""A bare byte relay in Python on uvloop (the proxy's own loop): the floor of what any relay
written in Python costs, for `kvpool bench proxy --py-relay` to show beside nginx and the proxy.

Each accepted connection gets its own upstream connection; the bytes of either side are written
on to the other in the callback that read them (no parsing, no task per read), as nginx relays
with `proxy_buffering off`. A side whose peer cannot keep up stops being read until the peer's
buffer drains (`pause_writing` / `resume_writing`), a side that ends its sending passes the
half-close on, and a side that closes closes the other.

    python -m kvpool.bench.loop_relay PORT UPSTREAM_HOST UPSTREAM_PORT     (listens on 127.0.0.1)
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from typing import Any

import uvloop

from kvpool.launch.children import die_with_parent, stop
from kvpool.launch.ports import free_port
from kvpool.launch.wait import wait_port

HOST = "127.0.0.1"


class _Side(asyncio.Protocol):
    """One connection; `peer` is the other side's transport once it exists."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.peer: _Side | None = None
        self._early: list[bytes] = []
        """What came before the peer was connected."""
        self._eof = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def join(self, peer: _Side) -> None:
        self.peer = peer
        out = peer.transport
        assert out is not None
        for data in self._early:
            out.write(data)
        self._early.clear()
        if self._eof and out.can_write_eof():
            out.write_eof()

    def data_received(self, data: bytes) -> None:
        peer = self.peer
        if peer is None or peer.transport is None:
            self._early.append(data)
        else:
            peer.transport.write(data)

    def eof_received(self) -> bool:
        self._eof = True
        peer = self.peer
        if peer is not None and peer.transport is not None and peer.transport.can_write_eof():
            peer.transport.write_eof()
        return True  # keep this side open for the other direction

    def connection_lost(self, exc: Exception | None) -> None:
        peer = self.peer
        if peer is not None and peer.transport is not None:
            peer.transport.close()

    def pause_writing(self) -> None:  # this side's buffer is full: stop reading its peer
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.resume_reading()


class _Client(_Side):
    """An accepted connection: connects its upstream, then joins the two."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        super().__init__()
        self._upstream = upstream

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        asyncio.ensure_future(self._connect())

    async def _connect(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            _, up = await loop.create_connection(_Side, *self._upstream)
        except OSError:
            if self.transport is not None:
                self.transport.close()
            return
        if self.transport is None or self.transport.is_closing():
            up.transport.close()  # type: ignore[union-attr]
            return
        up.join(self)
        self.join(up)


async def serve(port: int, upstream: tuple[str, int]) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Client(upstream), HOST, port)
    async with server:
        await server.serve_forever()


@contextmanager
def running_loop_relay(upstream_port: int, module: str = __name__) -> Iterator[tuple[int, int]]:
    """A relay (a child process running `module`, this one or another taking the same
    arguments) to `HOST:upstream_port`: (its port, its pid) once it listens (KvpoolError if it
    exits first, TimeoutError after 10 s); stopped on exit."""
    port = free_port(HOST)
    proc = subprocess.Popen([sys.executable, "-m", module, str(port), HOST, str(upstream_port)],
                            stdout=subprocess.DEVNULL, preexec_fn=die_with_parent(os.getpid()))
    try:
        wait_port(port, HOST, 10.0, procs=[proc])  # KvpoolError if it exits first
        yield port, proc.pid
    finally:
        stop(proc, timeout_s=5.0, sig=15)


Serve = Callable[[int, tuple[str, int]], Coroutine[Any, Any, None]]
"""A relay's `serve(port, (upstream host, upstream port))`."""


def relay_main(argv: list[str], serve_relay: Serve, usage: str) -> int:
    """A relay's `python -m`: PORT UPSTREAM_HOST UPSTREAM_PORT, served until stopped."""
    if len(argv) != 3:
        print(usage, file=sys.stderr)
        return 2
    uvloop.run(serve_relay(int(argv[0]), (argv[1], int(argv[2]))))
    return 0


def main(argv: list[str]) -> int:
    return relay_main(argv, serve, __doc__.strip().splitlines()[-1].strip())


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
