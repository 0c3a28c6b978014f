"""The proxy's lean client's read timeout (`worker_stream`): one timer per connection, not one
per read. A read that waits longer than its limit is a TimeoutError; a stream whose frames keep
coming is never cut however long it runs; a cancel from elsewhere stays a cancel."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest

from kvpool.serve.worker_stream import PAUSE_BYTES, LineRelay, StreamPool
from tests.serve.test_worker_client import read_request

HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: application/x-ndjson\r\nTransfer-Encoding: chunked\r\n\r\n"


@asynccontextmanager
async def _serving(serve: Callable[[asyncio.StreamReader, asyncio.StreamWriter],
                                   Awaitable[None]]) -> AsyncIterator[str]:
    """`serve` on a port of its own: its base URL."""
    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()


@asynccontextmanager
async def paced_server(gaps_s: list[float]) -> AsyncIterator[str]:
    """Answers one POST with a line after each gap of `gaps_s`, then ends the reply."""
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await read_request(reader)
            writer.write(HEAD)
            for i, gap in enumerate(gaps_s):
                await asyncio.sleep(gap)
                line = b'{"n":%d}\n' % i
                writer.write(b"%x\r\n%s\r\n" % (len(line), line))
                await writer.drain()
            writer.write(b"0\r\n\r\n")
            await writer.drain()
            await reader.read()  # until the client closes
        except ConnectionError:
            pass
        finally:
            writer.close()

    async with _serving(serve) as url:
        yield url


async def _lines(url: str, read_s: float, on_lines: Callable[[], None] | None = None,
                 relay: LineRelay | None = None) -> list[bytes]:
    """The lines of one streamed call (`relay`: relayed in the read callback meanwhile)."""
    pool = StreamPool(5.0)
    if on_lines is not None:
        pool.on_lines = on_lines
    call = await pool.open(url, "/generate", {}, b"{}", 1.0, read_s)
    try:
        if relay is not None:
            call.relay_with(relay)
        out: list[bytes] = []
        while batch := await call.next_lines():
            out += batch
        return out
    finally:
        call.close()
        pool.close()


def test_a_stream_whose_frames_keep_coming_is_never_cut() -> None:
    """20 frames 0.05 s apart (1 s in all) with a 0.3 s read limit: each read is short."""
    async def go() -> None:
        async with paced_server([0.05] * 20) as url:
            assert len(await _lines(url, 0.3)) == 20
    asyncio.run(go())


def test_the_pool_is_told_as_a_streamed_replys_lines_are_taken() -> None:
    """`on_lines` (the proxy's loop poller) is called each time lines are taken: once per
    frame sent apart from the others, and once at the end."""
    taken: list[float] = []

    async def go() -> None:
        async with paced_server([0.02] * 5) as url:
            assert len(await _lines(url, 1.0, lambda: taken.append(time.monotonic()))) == 5
    asyncio.run(go())
    assert len(taken) == 6


def test_a_read_that_waits_past_its_limit_is_a_timeout() -> None:
    async def go() -> None:
        async with paced_server([0.0, 0.05, 2.0]) as url:
            t0 = time.monotonic()
            with pytest.raises(TimeoutError):
                await _lines(url, 0.3)
            assert 0.3 <= time.monotonic() - t0 < 1.5
    asyncio.run(go())


def test_a_cancel_from_elsewhere_stays_a_cancel() -> None:
    async def go() -> None:
        async with paced_server([0.0, 2.0]) as url:
            task = asyncio.ensure_future(_lines(url, 0.3))
            await asyncio.sleep(0.1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
    asyncio.run(go())


@asynccontextmanager
async def burst_server(lines: int, line_bytes: int, extra: bytes = b"") -> AsyncIterator[str]:
    """Answers each POST with `lines` lines of `line_bytes` at once (one chunk each), then
    `extra` a little after the reply's end (a server that talks out of turn)."""
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                await read_request(reader)
                writer.write(HEAD)
                for i in range(lines):
                    line = (b'{"n":%d,"pad":"' % i).ljust(line_bytes - 3, b"x") + b'"}\n'
                    writer.write(b"%x\r\n%s\r\n" % (len(line), line))
                writer.write(b"0\r\n\r\n")
                await writer.drain()
                if extra:
                    await asyncio.sleep(0.05)  # after the client has read the reply
                    writer.write(extra)
        except (ConnectionError, asyncio.IncompleteReadError, ValueError):
            pass
        finally:
            writer.close()

    async with _serving(serve) as url:
        yield url


def test_a_reader_that_falls_behind_stops_the_socket_and_loses_nothing() -> None:
    """4 MiB of lines sent at once to a reader that does not read for a while: the connection
    stops reading past PAUSE_BYTES unread (the kernel's buffers hold the rest, and the sender
    waits), and once read every line comes whole and in order; the connection then carries
    the next call."""
    async def go() -> None:
        async with burst_server(4096, 1024) as url:
            pool = StreamPool(5.0)
            call = await pool.open(url, "/generate", {}, b"{}", 1.0, 5.0)
            conn = call._conn
            await asyncio.sleep(0.3)  # nobody reads: all of it would be in by now
            assert call.reply.pending_bytes <= 2 * PAUSE_BYTES + 4096  # a read past the mark
            seen: list[int] = []
            while batch := await call.next_lines():
                seen += [int(line[5:line.index(b",")]) for line in batch]
            call.close()
            assert seen == list(range(4096))
            again = await pool.open(url, "/generate", {}, b"{}", 1.0, 5.0)
            assert again._conn is conn  # read whole: kept alive
            assert len(await again.read_all()) == 4096 * 1024
            again.close()
            pool.close()
    asyncio.run(go())


def test_a_server_that_talks_between_replies_loses_its_connection() -> None:
    async def go() -> None:
        async with burst_server(2, 64, extra=b"HTTP/1.1 200 OK\r\n\r\n") as url:
            pool = StreamPool(5.0)
            call = await pool.open(url, "/generate", {}, b"{}", 1.0, 5.0)
            conn = call._conn
            assert len(await call.read_all()) == 128
            call.close()
            await asyncio.sleep(0.1)  # the stray bytes arrive while it is idle
            assert not conn.usable
            again = await pool.open(url, "/generate", {}, b"{}", 1.0, 5.0)
            assert again._conn is not conn
            assert len(await again.read_all()) == 128
            again.close()
            pool.close()
    asyncio.run(go())
