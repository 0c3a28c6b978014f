"""The proxy's end of a worker channel (serve/worker_channel.py), against a scripted server
on a real socket: each request's lines reach its call in order, its end ends it, lines for a
call that has gone are dropped; a channel that breaks, ends or sends a line of another form
fails every call on it after the lines that came before; a silent call times out on its own
while the channel stays; a first line that is not a channel's id is refused at the open."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from kvpool.serve.ndjson_reply import ReplyError
from kvpool.serve.worker_channel import ChannelBroken, ChannelRefused, WorkerChannel
from kvpool.serve.worker_stream import StreamPool
from tests.serve.test_worker_client import read_request

HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: application/x-ndjson\r\nTransfer-Encoding: chunked\r\n\r\n"


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


@asynccontextmanager
async def scripted(first: bytes = b"channel abc123\n",
                   status: bytes = b"200 OK") -> AsyncIterator[tuple[str, asyncio.Queue[bytes | None]]]:
    """A server answering GET /channel with `first`, then whatever the test puts in the
    queue (None: the connection ends there)."""
    sends: asyncio.Queue[bytes | None] = asyncio.Queue()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await read_request(reader)
            if status != b"200 OK":
                body = b'{"error": {"message": "no"}}'
                writer.write(b"HTTP/1.1 %s\r\nContent-Length: %d\r\n\r\n%s"
                             % (status, len(body), body))
                await writer.drain()
                return
            writer.write(HEAD + _chunk(first))
            while (data := await sends.get()) is not None:
                writer.write(_chunk(data))
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", sends
    finally:
        server.close()


async def _open(url: str, read_s: float = 5.0) -> tuple[WorkerChannel, StreamPool]:
    pool = StreamPool(5.0)
    return await WorkerChannel.open(pool, url, {}, 1.0, read_s), pool


async def _all(call: object) -> list[bytes]:
    out: list[bytes] = []
    while batch := await call.next_lines():  # type: ignore[attr-defined]
        out += batch
    return out


def test_each_requests_lines_reach_its_call_and_its_end_ends_it() -> None:
    async def run() -> tuple[list[bytes], list[bytes], bool]:
        async with scripted() as (url, sends):
            channel, pool = await _open(url)
            assert channel.id == "abc123"
            a, b, gone = channel.call(), channel.call(), channel.call()
            gone.close()  # its lines are nobody's now
            sends.put_nowait(b"%d {\"n\":1}\n%d {\"m\":1}\n%d {\"x\":1}\n" % (a.sid, b.sid, gone.sid))
            sends.put_nowait(b"%d {\"n\":2}\n%d\n" % (a.sid, a.sid))
            sends.put_nowait(b"%d {\"m\":2}\n%d\n" % (b.sid, b.sid))
            got_a, got_b = await asyncio.wait_for(asyncio.gather(_all(a), _all(b)), 5)
            open_after = not channel.closed
            await channel.aclose()
            pool.close()
            return got_a, got_b, open_after
    got_a, got_b, open_after = asyncio.run(run())
    assert got_a == [b'{"n":1}', b'{"n":2}'] and got_b == [b'{"m":1}', b'{"m":2}']
    assert open_after


@pytest.mark.parametrize("how", ["eof", "junk"])
def test_a_channel_that_ends_fails_every_call_after_the_lines_before(how: str) -> None:
    async def run() -> tuple[list[bytes], BaseException, BaseException, bool]:
        async with scripted() as (url, sends):
            channel, pool = await _open(url)
            a, b = channel.call(), channel.call()
            sends.put_nowait(b"%d {\"n\":1}\n" % a.sid)
            sends.put_nowait(None if how == "eof" else b"not-a-sid {}\n")
            first = await asyncio.wait_for(a.next_lines(), 5)
            errors = []
            for call in (a, b):
                with pytest.raises(ChannelBroken) as info:
                    await asyncio.wait_for(call.next_lines(), 5)
                errors.append(info.value)
            with pytest.raises(ChannelBroken):
                channel.call()
            pool.close()
            return first, errors[0], errors[1], channel.closed
    first, err_a, err_b, closed = asyncio.run(run())
    assert first == [b'{"n":1}'] and closed
    assert isinstance(err_a, OSError)  # the worker failed, not the request: migratable
    if how == "junk":
        assert "not a channel line" in str(err_b)


def test_a_silent_call_times_out_and_the_channel_stays() -> None:
    async def run() -> bool:
        async with scripted() as (url, sends):
            channel, pool = await _open(url, read_s=0.1)
            call = channel.call()
            with pytest.raises(TimeoutError):
                await call.next_lines()
            call.close()
            await asyncio.sleep(0.3)  # the channel itself has no read timeout
            other = channel.call()
            sends.put_nowait(b"%d {\"n\":1}\n%d\n" % (other.sid, other.sid))
            assert await asyncio.wait_for(_all(other), 5) == [b'{"n":1}']
            alive = not channel.closed
            await channel.aclose()
            pool.close()
            return alive
    assert asyncio.run(run())


def test_an_open_that_is_not_a_channel_is_refused() -> None:
    async def run(first: bytes, status: bytes) -> None:
        async with scripted(first, status) as (url, _):
            pool = StreamPool(5.0)
            try:
                await WorkerChannel.open(pool, url, {}, 1.0, 5.0)
            finally:
                pool.close()
    with pytest.raises(ReplyError, match="not a channel's first line"):
        asyncio.run(run(b'{"type":"tokens"}\n', b"200 OK"))
    with pytest.raises(ChannelRefused) as info:
        asyncio.run(run(b"", b"401 Unauthorized"))
    assert info.value.status == 401
