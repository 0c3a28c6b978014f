"""Calls to workers over kept-alive HTTP/1.1 connections of the proxy's own (an asyncio
protocol feeding `ndjson_reply.ReplyReader` in the transport's own callback), for the calls on
the proxy's hot paths: /generate (whose lines the proxy reads per frame), /prefill, and the
/load polls (16 workers polled through httpx took a fifth of the proxy's CPU). The rest (the
challenge, aborts) stays on httpx.

Through httpx each streamed request checked every idle connection of the pool with a system
call, and each line went through four nested async generators and a text decoder; the lean
reader reads whatever has arrived and hands over all of its complete lines at once (figures in
docs/serve.md, "The proxy's own cost").

    call = await pool.open(url, path, headers, body, connect_s, read_s[, method])  # head in
    call.status;  await call.next_lines() -> [line, ...] ([] once the body has ended)
    await call.read_all() -> the body (an error reply);  call.close()  (always)
    await call_whole(pool, http, url, path, headers, body, ...) -> (status, body)  (one call,
        read whole; an https:// URL through httpx)

A streamed call may relay its lines in the transport's callback (`call.relay_with(take)`):
while its reader waits for more, what arrives goes to `take(reply)` first, which takes the
complete lines it can relay (`reply.lines()`), gives back those it cannot (`put_back`) and
says whether anything is left for the reader; the reader is woken only then. So a frame
relayed this way costs no task switch and none of the reader's layers (docs/serve.md, "Relayed
in the read callback").

A connection goes back to the pool only after a whole reply was read; one closed early (a stop
string, a client gone, a cancel) is closed. An idle connection is used again within
`keepalive_s` of its last reply (CLIENT_KEEPALIVE_S, well before the server drops it); if the
server closed it meanwhile (nothing of the reply came back), the request is sent once more on
a new connection: a server that closed an idle connection has not read the request.

Raises OSError (connection refused, reset), TimeoutError (connect or a read over its time),
ReplyError (not an HTTP/1.1 reply, or one cut short).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Protocol
from urllib.parse import urlsplit

import httpx

from kvpool.idle_timeout import IdleTimeout
from kvpool.serve.ndjson_reply import ReplyError, ReplyReader

PAUSE_BYTES = 1 << 18
"""Body bytes a connection holds unread (its lines not yet taken) before it stops reading the
socket; it reads again when its reader asks for more."""


class LineRelay(Protocol):
    def __call__(self, reply: ReplyReader) -> bool:
        """Take what can be relayed now of `reply`'s complete lines (giving the rest back);
        True when nothing is left for the reader (it is not woken)."""


class _Conn(asyncio.Protocol):
    """One kept-alive connection. What arrives goes into the reply being read (its
    `ReplyReader`) in the transport's own callback, and the reading task is woken only while it
    waits; its waits share one timer (`IdleTimeout`). Between replies nothing may arrive: a
    server that talks out of turn has its connection closed."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.reply: ReplyReader | None = None
        """The reply being read (None between calls)."""
        self.received = 0
        """Bytes of the current reply received so far."""
        self.failure: BaseException | None = None
        """Why the connection cannot go on (a ReplyError for bytes that are not the reply, an
        OSError for a connection lost), raised to the reader when it asks for more."""
        self.ended = False
        """The server ended its side (or the connection is lost)."""
        self.idle_since = 0.0
        self.deadline = IdleTimeout()
        self._waiter: asyncio.Future[None] | None = None
        self.relay: LineRelay | None = None
        """The current call's relay (`StreamCall.relay_with`), if any."""
        self._paused = False
        self._loop: asyncio.AbstractEventLoop | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self._loop = asyncio.get_running_loop()

    def data_received(self, data: bytes) -> None:
        reply = self.reply
        if reply is None:
            self._fail(ReplyError(f"data between replies: {data[:60]!r}"))
            return
        self.received += len(data)
        if self.failure is None:
            try:
                reply.feed(data)
            except ReplyError as exc:
                self._fail(exc)
                return
            if self.relay is not None and self._waiting() and self._relayed(reply):
                return  # all of it relayed (the reader waits on), or the relay failed
        if reply.pending_bytes > PAUSE_BYTES and not self._paused:
            self._paused = True
            self.transport.pause_reading()  # type: ignore[union-attr]
        self._wake()

    def _waiting(self) -> bool:
        """The reader waits in `more` (not cancelled meanwhile)."""
        waiter = self._waiter
        return waiter is not None and not waiter.done()

    def _relayed(self, reply: ReplyReader) -> bool:
        """Relay what came while the reader waits (only then: whatever it has not read yet
        goes first); True when nothing is left to do here: all of it relayed, or the relay
        failed, which fails the connection (the reader is woken to raise the error)."""
        try:
            done = self.relay(reply)  # type: ignore[misc]
        except Exception as exc:  # noqa: BLE001 - raised to the reader, not lost in the loop
            self._fail(exc)
            return True
        if done:
            self.deadline.touch()
        return done

    def eof_received(self) -> bool:
        self.ended = True
        self._wake()
        return False  # the transport closes itself

    def connection_lost(self, exc: Exception | None) -> None:
        self.ended = True
        if exc is not None and self.failure is None:
            self.failure = exc
        self._wake()

    def _fail(self, exc: BaseException) -> None:
        self.failure = exc
        if self.transport is not None:
            self.transport.close()
        self._wake()

    def _wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    @property
    def usable(self) -> bool:
        """Whether it may carry another request."""
        return not self.ended and self.failure is None and self.transport is not None \
            and not self.transport.is_closing()

    async def more(self, read_s: float) -> None:
        """Wait (up to `read_s`: TimeoutError) until something new has come for the reply:
        bytes, or its end (then `end_of_input`: ReplyError if it was cut short). Raises why
        the connection failed, if it did."""
        reply = self.reply
        assert reply is not None
        if self._paused:
            self._paused = False
            self.transport.resume_reading()  # type: ignore[union-attr]
        if self.failure is None and not self.ended:
            waiter = self._waiter = self._loop.create_future()  # type: ignore[union-attr]
            try:
                await self.deadline.wait(waiter, read_s)
            finally:
                self._waiter = None
        if self.failure is not None:
            raise self.failure
        if self.ended:
            reply.end_of_input()

    def close(self) -> None:
        self.deadline.close()
        if self.transport is not None:
            self.transport.close()


class StreamCall:
    """One request's reply on one connection; `close()` it however it ends."""

    def __init__(self, pool: StreamPool, key: tuple[str, int], conn: _Conn, read_s: float,
                 reply: ReplyReader) -> None:
        self._pool, self._key, self._conn, self._read_s = pool, key, conn, read_s
        self.reply = reply
        self._closed = False

    @property
    def status(self) -> int:
        return self.reply.status

    async def next_lines(self) -> list[bytes]:
        """The body's complete lines that have come since the last call (waiting for at least
        one), or [] once the body has ended."""
        reply = self.reply
        while True:
            lines = reply.lines()
            if lines or reply.done:
                self._pool.on_lines()
                return lines
            await self._conn.more(self._read_s)

    async def read_all(self) -> bytes:
        while not self.reply.done:
            await self._conn.more(self._read_s)
        return self.reply.body()

    def relay_with(self, relay: LineRelay) -> None:
        """Relay this reply's lines in the transport's callback from now on (while the
        reader waits in `next_lines`)."""
        self._conn.relay = relay

    def close(self) -> None:
        conn = self._conn
        if self._closed:
            return
        self._closed = True
        conn.relay = None
        if self.reply.keep_alive and conn.usable:
            self._pool.put_back(self._key, conn)
        else:
            conn.close()


class StreamPool:
    """Idle connections by (host, port)."""

    def __init__(self, keepalive_s: float, now: Callable[[], float] = time.monotonic) -> None:
        self.keepalive_s, self.now = keepalive_s, now
        self._idle: dict[tuple[str, int], list[_Conn]] = {}
        self.on_lines: Callable[[], None] = _nothing
        """Called as a streamed reply's lines are taken (`StreamCall.next_lines`): more are
        expected soon (the proxy's loop poller; not for replies read whole, such as polls)."""

    async def open(self, url: str, path: str, headers: dict[str, str], body: bytes,
                   connect_s: float, read_s: float, method: str = "POST") -> StreamCall:
        """`method` (POST: `body`) to `url + path`; the call once the reply's head is in."""
        key, netloc, base = _host_port(url)
        data = _request(method, netloc, base + path, headers, body)
        conn = self._take(key)
        if conn is not None:
            try:
                return await self._send(key, conn, data, read_s)
            except _Stale:  # closed by the server while idle: once more, on a new one
                pass
        loop = asyncio.get_running_loop()
        _, fresh = await asyncio.wait_for(loop.create_connection(_Conn, *key), connect_s)
        try:
            return await self._send(key, fresh, data, read_s)
        except _Stale as exc:
            raise exc.cause from None

    async def _send(self, key: tuple[str, int], conn: _Conn, data: bytes,
                    read_s: float) -> StreamCall:
        """Send `data` on `conn`, read the reply's head. _Stale when the connection failed
        before a byte of the reply came back."""
        reply = conn.reply = ReplyReader()
        conn.received = 0
        try:
            conn.transport.write(data)  # type: ignore[union-attr]
            while not reply.status:
                await conn.more(read_s)
        except (OSError, ReplyError) as exc:
            conn.close()
            if conn.received or isinstance(exc, TimeoutError):
                raise
            raise _Stale(exc) from None
        except BaseException:
            conn.close()
            raise
        return StreamCall(self, key, conn, read_s, reply)

    def _take(self, key: tuple[str, int]) -> _Conn | None:
        idle = self._idle.get(key)
        now = self.now()
        while idle:
            conn = idle.pop()
            if now - conn.idle_since < self.keepalive_s and conn.usable:
                return conn
            conn.close()
        return None

    def put_back(self, key: tuple[str, int], conn: _Conn) -> None:
        conn.reply = None
        conn.idle_since = self.now()
        self._idle.setdefault(key, []).append(conn)

    def close(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()


async def call_once(pool: StreamPool, url: str, path: str, headers: dict[str, str], body: bytes,
                    connect_s: float, read_s: float, method: str = "POST") -> tuple[int, bytes]:
    """One call read whole on one of `pool`'s connections: (status, body). Raises what
    `open` and the reads raise (OSError, TimeoutError, ReplyError, ValueError for a URL it
    cannot use)."""
    call = await pool.open(url, path, headers, body, connect_s, read_s, method)
    try:
        return call.status, await call.read_all()
    finally:
        call.close()


async def call_whole(pool: StreamPool, http: httpx.AsyncClient, url: str, path: str,
                     headers: dict[str, str], body: bytes, connect_s: float, read_s: float,
                     method: str = "POST") -> tuple[int, bytes]:
    """`call_once` for an http:// URL; another (https://) goes through `http`. Raises what
    `call_once` raises, or httpx.HTTPError."""
    if url.startswith("http://"):
        return await call_once(pool, url, path, headers, body, connect_s, read_s, method)
    resp = await http.request(method, url + path, content=body or None, headers=headers,
                              timeout=read_s)
    return resp.status_code, resp.content


def _nothing() -> None:
    pass


class _Stale(Exception):
    def __init__(self, cause: OSError | ReplyError) -> None:
        self.cause = cause


def _host_port(url: str) -> tuple[tuple[str, int], str, str]:
    """((host, port), the Host header's value, the path the URL ends with, no trailing /) of
    an http:// URL (a call's path goes after that one); ValueError otherwise."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"not an http:// URL: {url!r}")
    return (parts.hostname, parts.port or 80), parts.netloc, parts.path.rstrip("/")


def _request(method: str, netloc: str, path: str, headers: dict[str, str],
             body: bytes) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", f"Host: {netloc}", f"Content-Length: {len(body)}",
             *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body
