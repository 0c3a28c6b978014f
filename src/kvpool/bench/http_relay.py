"""The least HTTP relay in Python on uvloop: what any front door written in Python spends to
relay a worker's stream once it reads HTTP, for `kvpool bench proxy --py-relay` to show
beside nginx, the bare byte relay (`loop_relay`) and the proxy.

It does what nginx does with `proxy_buffering off` and kept-alive upstream connections, and
nothing more: each request is parsed (llhttp, through `httptools`, as uvicorn and the proxy
parse) and sent upstream as a new request (its method, path, content type and body); each
reply is parsed, its head written anew and its body written on re-chunked, one write per read
(whatever chunks the read held). No routing, no JSON, no tokens: every accepted connection has
one upstream connection of its own, kept while both live.

    python -m kvpool.bench.http_relay PORT UPSTREAM_HOST UPSTREAM_PORT     (listens on 127.0.0.1)

Bytes that llhttp cannot read as a request or a reply, or an upstream that cannot be reached
or closes early, close the client's connection.
"""

from __future__ import annotations

import asyncio
import sys
from contextlib import AbstractContextManager

import httptools

from kvpool.bench.loop_relay import HOST, relay_main, running_loop_relay

_REASONS = {200: b"OK", 400: b"Bad Request", 404: b"Not Found", 429: b"Too Many Requests",
            500: b"Internal Server Error", 503: b"Service Unavailable"}


class _Upstream(asyncio.Protocol):
    """The upstream side: its replies parsed, their bodies re-chunked to the client."""

    def __init__(self, client: _Client) -> None:
        self.client = client
        self.transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._out: list[bytes] = []
        """What one read made for the client."""
        self._type = b"application/octet-stream"

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError:
            self.client.close()
            return
        if self._out:
            self.client.write(b"".join(self._out))
            self._out.clear()

    def on_message_begin(self) -> None:
        self._type = b"application/octet-stream"

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"content-type":
            self._type = value

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        self._out.append(b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ntransfer-encoding: chunked\r\n"
                         b"\r\n" % (status, _REASONS.get(status, b"Status"), self._type))

    def on_body(self, body: bytes) -> None:
        self._out.append(b"%x\r\n%s\r\n" % (len(body), body))

    def on_message_complete(self) -> None:
        self._out.append(b"0\r\n\r\n")

    def connection_lost(self, exc: Exception | None) -> None:
        self.client.close()

    def pause_writing(self) -> None:  # the worker cannot take more: stop reading the client
        self.client.pause(True)

    def resume_writing(self) -> None:
        self.client.pause(False)


class _Client(asyncio.Protocol):
    """An accepted connection: its requests parsed and sent to its own upstream connection."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self._upstream = upstream
        self.transport: asyncio.Transport | None = None
        self.up: _Upstream | None = None
        self._parser = httptools.HttpRequestParser(self)
        self._url = b""
        self._type = b"application/json"
        self._body: list[bytes] = []
        self._early: list[bytes] = []
        """Requests made before the upstream connection was up."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        asyncio.ensure_future(self._connect())

    async def _connect(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            _, up = await loop.create_connection(lambda: _Upstream(self), *self._upstream)
        except OSError:
            self.close()
            return
        if self.transport is None or self.transport.is_closing():
            up.transport.close()  # type: ignore[union-attr]
            return
        self.up = up
        for request in self._early:
            up.transport.write(request)  # type: ignore[union-attr]
        self._early.clear()

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError:
            self.close()

    def on_message_begin(self) -> None:
        self._url, self._type, self._body = b"", b"application/json", []

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"content-type":
            self._type = value

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        body = b"".join(self._body)
        method = self._parser.get_method()
        request = b"%s %s HTTP/1.1\r\nhost: upstream\r\ncontent-type: %s\r\ncontent-length: %d" \
                  b"\r\n\r\n%s" % (method, self._url, self._type, len(body), body)
        up = self.up
        if up is None or up.transport is None:
            self._early.append(request)
        else:
            up.transport.write(request)

    def write(self, data: bytes) -> None:
        if self.transport is not None:
            self.transport.write(data)

    def pause(self, on: bool) -> None:
        if self.transport is not None and not self.transport.is_closing():
            (self.transport.pause_reading if on else self.transport.resume_reading)()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
        if self.up is not None and self.up.transport is not None:
            self.up.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.up is not None and self.up.transport is not None:
            self.up.transport.close()

    def pause_writing(self) -> None:  # the client cannot take more: stop reading upstream
        if self.up is not None and self.up.transport is not None:
            self.up.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.up is not None and self.up.transport is not None:
            self.up.transport.resume_reading()


async def serve(port: int, upstream: tuple[str, int]) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Client(upstream), HOST, port)
    async with server:
        await server.serve_forever()


def running_http_relay(upstream_port: int) -> AbstractContextManager[tuple[int, int]]:
    """This relay as a child process (`loop_relay.running_loop_relay`)."""
    return running_loop_relay(upstream_port, module=__name__)


def main(argv: list[str]) -> int:
    return relay_main(argv, serve, __doc__.strip().splitlines()[-4].strip())


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
