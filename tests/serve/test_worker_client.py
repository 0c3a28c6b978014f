"""WorkerClient against a real socket: each stream is read to its end, so one kept-alive
connection carries request after request (polls and prefill legs too); what follows a finish
line, or a stream that breaks before it, is a WorkerCallError."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from kvpool.engine.config import SamplingParams
from kvpool.engine.worker.messages import (
    FinishLine,
    Frame,
    GenerateRequest,
    PlainFrame,
    PrefillRequest,
)
from kvpool.errors import WorkerCallError
from kvpool.serve.worker_client import WorkerClient

LINES = [b'{"type":"tokens","token_ids":[5,6],"t":[1.5,1.5]}\n',
         b'{"type":"token","token_id":7}\n',  # a one-token line reads as a frame of one
         b'{"type":"finish","finish_reason":"length","num_output_tokens":3}\n']


async def read_request(reader: asyncio.StreamReader) -> bytes:
    """The next request's head (its body, Content-Length bytes, read and dropped)."""
    head = await reader.readuntil(b"\r\n\r\n")
    size = next(int(h.split(b":")[1]) for h in head.split(b"\r\n")
                if h.lower().startswith(b"content-length"))
    await reader.readexactly(size)
    return head


@asynccontextmanager
async def ndjson_server(lines: list[bytes], end: bool = True, status: int = 200,
                        one_reply: bool = False) -> AsyncIterator[tuple[str, list[int]]]:
    """A worker stand-in that answers every POST with `status` and `lines`, one chunk each
    (and the terminating chunk unless not `end`: then it closes the connection; with
    `one_reply` it closes it after each whole reply, as a server drops an idle connection);
    (url, a list that grows by one per accepted connection)."""
    accepted: list[int] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(1)
        try:
            while True:
                await read_request(reader)
                writer.write(b"HTTP/1.1 %d OK\r\nContent-Type: application/x-ndjson\r\n"
                             b"Transfer-Encoding: chunked\r\n\r\n" % status)
                for line in lines:
                    writer.write(b"%x\r\n%s\r\n" % (len(line), line))
                    await writer.drain()
                if not end:
                    break
                writer.write(b"0\r\n\r\n")
                if one_reply:
                    await writer.drain()
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", accepted
    finally:
        server.close()


def _request(i: int) -> GenerateRequest:
    return GenerateRequest(request_id=f"r{i}", prompt_token_ids=[1, 2, 3],
                           sampling=SamplingParams(max_tokens=2))


async def _all(client: WorkerClient, url: str, i: int) -> list[Frame | FinishLine]:
    return [line async for line in client.generate(url, _request(i))]


def test_streams_are_read_to_the_end_and_reuse_one_connection() -> None:
    async def go() -> None:
        client = WorkerClient(5.0)
        try:
            async with ndjson_server(LINES) as (url, accepted):
                for i in range(3):
                    got = await _all(client, url, i)
                    assert [type(g).__name__ for g in got] == ["PlainFrame", "TokensLine",
                                                               "FinishLine"]
                    assert isinstance(got[0], PlainFrame) and got[0].token_ids == [5, 6]
                    assert got[0].t == [1.5, 1.5]
                    assert isinstance(got[1], Frame) and got[1].token_ids == [7]
                    assert isinstance(got[2], FinishLine) and got[2].num_output_tokens == 3
                assert len(accepted) == 1
        finally:
            await client.aclose()
    asyncio.run(go())


@pytest.mark.parametrize(("lines", "end", "match"), [
    (LINES + [LINES[0]], True, "a line after the finish line"),
    (LINES[:2], False, "closed before the reply ended"),
])
def test_a_line_after_the_finish_or_a_stream_cut_before_it_fails(
        lines: list[bytes], end: bool, match: str) -> None:
    async def go() -> None:
        client = WorkerClient(5.0)
        try:
            async with ndjson_server(lines, end) as (url, _):
                with pytest.raises(WorkerCallError, match=match):
                    await _all(client, url, 0)
        finally:
            await client.aclose()
    asyncio.run(go())


def test_a_connection_the_server_closed_while_idle_is_replaced() -> None:
    async def go() -> None:
        client = WorkerClient(5.0)
        try:
            async with ndjson_server(LINES, one_reply=True) as (url, accepted):
                for i in range(3):
                    assert len(await _all(client, url, i)) == 3
                    await asyncio.sleep(0.05)  # its FIN arrives
                assert len(accepted) == 3
                await _all(client, url, 3)  # sent at once on one the server is closing
                assert len(accepted) == 4
        finally:
            await client.aclose()
    asyncio.run(go())


def test_an_error_reply_is_a_worker_call_error_with_its_status() -> None:
    async def go() -> None:
        client = WorkerClient(5.0)
        try:
            async with ndjson_server([b'{"error": {"message": "no such request"}}'],
                                     status=409) as (url, accepted):
                for i in range(2):
                    with pytest.raises(WorkerCallError, match="no such request") as err:
                        await _all(client, url, i)
                    assert err.value.status == 409
                assert len(accepted) == 1  # read whole: the connection stays
        finally:
            await client.aclose()
    asyncio.run(go())


def test_a_stream_that_breaks_after_its_finish_line_still_finishes() -> None:
    async def go() -> None:
        client = WorkerClient(5.0)
        try:
            async with ndjson_server(LINES, end=False) as (url, accepted):
                for i in range(2):
                    got = await _all(client, url, i)
                    assert isinstance(got[-1], FinishLine) and len(got) == 3
                assert len(accepted) == 2  # a stream cut short: its connection is not reused
        finally:
            await client.aclose()
    asyncio.run(go())


def test_polls_and_prefill_legs_share_the_kept_alive_connection() -> None:
    """/load (GET), /prefill and /generate go over one kept-alive connection of the proxy's
    own client; a refused poll is a WorkerCallError with its status, and the connection stays."""
    seen: list[bytes] = []
    accepted: list[int] = []
    replies = {b"GET /load?since=0": (200, b'{"num_waiting": 2, "events_to": 5}'),
               b"GET /under/load?since=0": (200, b'{"num_waiting": 3}'),
               b"GET /load?since=9": (409, b'{"error": {"message": "stale cursor"}}'),
               b"POST /prefill": (200, b'{"request_id": "p", "first_token_id": 7, '
                                       b'"num_prompt_tokens": 3}')}

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(1)
        try:
            while True:
                line = (await read_request(reader)).split(b" HTTP/1.1")[0]
                seen.append(line)
                status, body = replies[line]
                writer.write(b"HTTP/1.1 %d X\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (status, len(body), body))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def go() -> None:
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        client = WorkerClient(5.0)
        try:
            load = await client.load(url, "/load?since=0", 5.0)
            assert (load.num_waiting, load.events_to) == (2, 5)
            with pytest.raises(WorkerCallError, match="stale cursor") as err:
                await client.load(url, "/load?since=9", 5.0)
            assert err.value.status == 409
            reply = await client.prefill(url, PrefillRequest(
                request_id="p", prompt_token_ids=[1, 2, 3], sampling=SamplingParams()))
            assert reply.first_token_id == 7
            under = await client.load(url + "/under/", "/load?since=0", 5.0)  # a URL's path
            assert under.num_waiting == 3
            assert seen == [b"GET /load?since=0", b"GET /load?since=9", b"POST /prefill",
                            b"GET /under/load?since=0"]
            assert len(accepted) == 1
        finally:
            await client.aclose()
            server.close()
    asyncio.run(go())
