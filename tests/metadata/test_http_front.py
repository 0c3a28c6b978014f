"""The hot-route helpers: `Outbox` (a stream's chunks made by a task of their own, written in
one write for all that came meanwhile) and `EventStream(coalesce=True)` through a real ASGI
call: the same bytes, fewer writes, errors after what came before, a slow client holding the
maker back, and a client gone closing the stream's generators."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from kvpool.metadata.http_front import EventStream, LastChunk, Outbox
from kvpool.metadata.http_serving import BodyWriter, HttpLimits
from tests.metadata.test_http_serving import _post_head, _serving


async def _burst(sizes: list[int], pause_s: float = 0.0) -> AsyncIterator[bytes]:
    """Chunks made in bursts: `sizes[i]` chunks without waiting, then a pause."""
    n = 0
    for size in sizes:
        for _ in range(size):
            yield b"c%d;" % n
            n += 1
        await asyncio.sleep(pause_s)


def test_what_is_made_while_the_writer_waits_goes_out_in_one_take() -> None:
    async def go() -> list[bytes]:
        box = Outbox()
        maker = asyncio.ensure_future(box.fill(_burst([3, 1, 4], 0.02)))
        got = []
        while (data := await box.take()) is not None:
            got.append(data)
        await maker
        return got
    assert asyncio.run(go()) == [b"c0;c1;c2;", b"c3;", b"c4;c5;c6;c7;"]


def test_an_error_comes_after_the_chunks_before_it() -> None:
    async def failing() -> AsyncIterator[bytes]:
        yield b"a"
        yield "b"  # str is encoded
        raise RuntimeError("broke")

    async def go() -> None:
        box = Outbox()
        maker = asyncio.ensure_future(box.fill(failing()))
        assert await box.take() == b"ab"
        with pytest.raises(RuntimeError, match="broke"):
            await box.take()
        await maker
    asyncio.run(go())


def test_a_slow_writer_holds_the_maker_back() -> None:
    made = []

    async def endless() -> AsyncIterator[bytes]:
        while True:
            made.append(1)
            yield b"x" * 100

    async def go() -> None:
        box = Outbox(limit=1000)
        maker = asyncio.ensure_future(box.fill(endless()))
        await asyncio.sleep(0.05)
        assert len(made) == 10  # waits at the limit, nobody takes
        assert len(await box.take()) == 1000
        await asyncio.sleep(0.05)
        assert len(made) == 20
        maker.cancel()
        await asyncio.wait([maker])
    asyncio.run(go())


def _asgi_call(stream: EventStream, disconnect_after_s: float | None = None
               ) -> tuple[list[dict[str, object]], bool]:
    """Run the response as uvicorn would; (the messages sent, whether on_close saw the
    client gone)."""
    sent: list[dict[str, object]] = []
    closed: list[bool] = []
    stream.on_close = closed.append

    async def receive() -> dict[str, object]:
        if disconnect_after_s is None:
            await asyncio.Event().wait()
        await asyncio.sleep(disconnect_after_s or 0)
        return {"type": "http.disconnect"}

    async def send(message: dict[str, object]) -> None:
        sent.append(message)

    async def go() -> None:
        await stream({"type": "http", "asgi": {"spec_version": "2.4"}}, receive, send)
    asyncio.run(go())
    return sent, closed[0]


def test_a_coalesced_stream_sends_the_same_bytes_in_fewer_writes() -> None:
    plain, _ = _asgi_call(EventStream(_burst([3, 1, 4], 0.02)))
    joined, gone = _asgi_call(EventStream(_burst([3, 1, 4], 0.02), coalesce=True))
    body = [m for m in plain if m["type"] == "http.response.body"]
    fewer = [m for m in joined if m["type"] == "http.response.body"]
    assert b"".join(m["body"] for m in body) == b"".join(m["body"] for m in fewer)  # type: ignore[misc]
    assert (len(body), len(fewer)) == (9, 4) and not gone  # 8 chunks + the end; 3 + the end


def test_a_client_gone_closes_the_coalesced_streams_generator() -> None:
    closed = []

    async def endless() -> AsyncIterator[bytes]:
        try:
            while True:
                yield b"x"
                await asyncio.sleep(0.01)
        finally:
            closed.append(True)

    sent, gone = _asgi_call(EventStream(endless(), coalesce=True), disconnect_after_s=0.1)
    assert gone and closed == [True]
    assert sent[-1]["type"] == "http.response.body" and sent[-1]["more_body"] is True


def test_a_maker_stopped_while_it_waits_for_room_closes_the_stream() -> None:
    """A client that takes nothing and then goes: the stream's `finally` runs when the maker
    stops, not at some later collection."""
    closed = []

    async def endless() -> AsyncIterator[bytes]:
        try:
            while True:
                yield b"x" * 100
        finally:
            closed.append(True)

    async def go() -> None:
        box = Outbox(limit=1000)
        maker = asyncio.ensure_future(box.fill(endless()))
        await asyncio.sleep(0.05)  # waiting for room now
        box.stop(maker)
        await asyncio.wait([maker])
        assert maker.cancelled() and closed == [True]
    asyncio.run(go())


def test_a_cancel_from_inside_the_content_is_not_a_clean_end() -> None:
    """A CancelledError the writer did not ask for ends the response as one (no final empty
    chunk, the close told the client is gone), as it did before the outbox."""
    async def cancelled_inside() -> AsyncIterator[bytes]:
        yield b"a"
        gone = asyncio.get_running_loop().create_future()
        gone.cancel()
        await gone

    for coalesce in (False, True):
        with pytest.raises(asyncio.CancelledError):
            _asgi_call(EventStream(cancelled_inside(), coalesce=coalesce))


def test_a_client_gone_while_a_plain_stream_sends_closes_its_generator_first() -> None:
    """Without an outbox, a cancel that lands inside `send` (a server whose send waits for a
    slow client) still closes the stream's generator, before `on_close` runs: its legs end
    when the response does, not at a later collection."""
    order: list[str] = []

    async def endless() -> AsyncIterator[bytes]:
        try:
            while True:
                yield b"x"
        finally:
            order.append("generator closed")

    async def go() -> None:
        stream = EventStream(endless())
        stream.on_close = lambda gone: order.append(f"on_close {gone}")
        held = asyncio.Event()

        async def receive() -> dict[str, object]:
            await held.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, object]) -> None:
            if message.get("more_body"):
                held.set()
                await asyncio.Event().wait()  # blocked until the cancel comes

        await stream({"type": "http", "asgi": {"spec_version": "2.4"}}, receive, send)
    asyncio.run(go())
    assert order == ["generator closed", "on_close True"]


def test_a_last_chunk_ends_the_body_and_its_disconnect_is_no_client_gone() -> None:
    """A `LastChunk` goes out as the end of the body (one message), and the content is then
    closed; the disconnect that follows the finished response (uvicorn reports one) does not
    cancel a cleanup that awaits, nor count as a client gone."""
    order: list[str] = []

    async def content() -> AsyncIterator[bytes]:
        try:
            yield b"one"
            yield LastChunk(b"two")
            order.append("read on")  # never: the stream stops at the last chunk
        finally:
            await asyncio.sleep(0.05)  # a cleanup that awaits (an abort, a close)
            order.append("cleaned up")

    sent, gone = _asgi_call(EventStream(content()), disconnect_after_s=0.0)
    bodies = [(m["body"], m["more_body"]) for m in sent if m["type"] == "http.response.body"]
    assert bodies == [(b"one", True), (b"two", False)]
    assert order == ["cleaned up"] and gone is False


async def _endless(events: list[str]) -> AsyncIterator[bytes]:
    """A chunk every 10 ms until closed ("closed" in `events` then)."""
    try:
        while True:
            yield b"x"
            await asyncio.sleep(0.01)
    finally:
        events.append("closed")


def _until(events: list[str], event: str) -> None:
    deadline = time.monotonic() + 2
    while event not in events and time.monotonic() < deadline:
        time.sleep(0.01)


def test_on_httptools_a_client_gone_ends_the_stream_without_a_watcher_task() -> None:
    """The server tells the stream of its client's going (`BodyWriter.watch_disconnect`): the
    generator closes and `on_close(True)` runs at once, no task reads the disconnect; a
    stream that ended, on a connection kept alive and then closed, is no client gone."""
    events: list[str] = []

    async def short() -> AsyncIterator[bytes]:
        yield LastChunk(b"done")

    async def app(scope: dict, receive: object, send: object) -> None:  # type: ignore[type-arg]
        tasks = len(asyncio.all_tasks())
        stream = EventStream(_endless(events) if scope["path"] == "/endless" else short())
        stream.on_close = lambda gone: events.append(f"on_close {gone} {tasks}")
        await stream(scope, receive, send)
        events.append(f"tasks {len(asyncio.all_tasks())}")

    with _serving(HttpLimits(idle_timeout_s=30), app) as port:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(_post_head(0).replace(b"POST / ", b"POST /short "))
            reply = b""
            while not reply.endswith(b"0\r\n\r\n"):
                reply += s.recv(4096)
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(_post_head(0).replace(b"POST / ", b"POST /endless "))
            assert s.recv(4096).startswith(b"HTTP/1.1 200")
        _until(events, "closed")
    # the short stream: no client gone, and no task left beside the request's own
    # (the tasks counted before the stream began, then after it ended)
    (_, short_gone, before), after = events[0].split(), events[1]
    assert short_gone == "False" and after == f"tasks {before}"
    # the endless one: its generator closed, then on_close told the client went
    assert events[2] == "closed" and events[3].split()[:2] == ["on_close", "True"]


def test_a_client_gone_with_a_request_pipelined_behind_its_stream_ends_the_stream() -> None:
    """uvicorn marks a lost connection on its newest request only: with a second request
    pipelined behind a stream, the stream itself is told all the same (its generator closes,
    `on_close(True)`)."""
    events: list[str] = []

    async def app(scope: dict, receive: object, send: object) -> None:  # type: ignore[type-arg]
        stream = EventStream(_endless(events))
        stream.on_close = lambda gone: events.append(f"on_close {gone}")
        await stream(scope, receive, send)

    with _serving(HttpLimits(idle_timeout_s=30), app) as port:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(_post_head(0) + _post_head(0))  # the second waits behind the first
            assert s.recv(4096).startswith(b"HTTP/1.1 200")
        _until(events, "on_close True")
    assert events == ["closed", "on_close True"]


def test_a_stream_whose_connection_the_server_closed_before_it_began_writes_nothing() -> None:
    """A connection closed by the server (evicted at the connection limit: the request
    pipelined behind a stream's had stalled its body) before the stream began: the stream is
    told at once, when it starts, and writes nothing (uvicorn marked the queued request, not
    the stream's, and a write on the closed transport would raise)."""
    events: list[str] = []

    async def app(scope: dict, receive: object, send: object) -> None:  # type: ignore[type-arg]
        if scope["path"] == "/slow":
            await asyncio.sleep(1.2)  # waits, as a request may for its worker
        stream = EventStream(_endless(events))
        stream.on_close = lambda gone: events.append(f"on_close {gone}")
        await stream(scope, receive, send)

    limits = HttpLimits(max_concurrency=2, body_idle_s=0.3, idle_timeout_s=30)
    with _serving(limits, app) as port:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as a:
            a.sendall(_post_head(0).replace(b"POST / ", b"POST /slow ") + _post_head(10) + b"ab")
            time.sleep(0.6)  # the second request's body stalls
            with socket.create_connection(("127.0.0.1", port), timeout=5):
                assert a.recv(100) == b""  # evicted for the new connection
                _until(events, "on_close True")
    assert events == ["closed", "on_close True"]


def test_pipelined_streams_written_from_callbacks_keep_apart_and_a_kept_writer_goes_quiet(
        ) -> None:
    """Two pipelined streams, each written by its BodyWriter from loop callbacks: each
    response has its own chunks only; the first's writer, kept past its response (as a relay
    may keep it), is never ready again and its watch never fires (its cycle, held weakly, is
    gone)."""
    import gc

    from kvpool.metadata.http_serving import BODY_WRITER

    kept: list[BodyWriter] = []
    log: list[object] = []

    async def app(scope: dict, receive: Any, send: Any) -> None:  # type: ignore[type-arg]
        n, writer = len(kept), scope["extensions"][BODY_WRITER]
        kept.append(writer)
        loop = asyncio.get_running_loop()

        def write(i: int) -> None:
            if writer.ready():
                writer.write(b"r%d-%d;" % (n, i))

        async def content() -> AsyncIterator[bytes]:
            for i in range(5):
                loop.call_soon(write, i)
                await asyncio.sleep(0.005)
            if n == 1:  # the first response is over
                gc.collect()
                log.append(kept[0].ready())
                kept[0].watch_disconnect(lambda: log.append("fired"))()
                await asyncio.sleep(0.01)
            yield LastChunk(b"end%d" % n)

        await EventStream(content(), on_writer=lambda w: None)(scope, receive, send)

    with _serving(HttpLimits(idle_timeout_s=30), app) as port, \
            socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(_post_head(0) + _post_head(0))
        data = b""
        while data.count(b"0\r\n\r\n") < 2:
            part = s.recv(65536)
            assert part, data
            data += part
    first, second = data.split(b"HTTP/1.1 200")[1:]
    for n, part in enumerate((first, second)):
        assert all(b"r%d-%d;" % (n, i) in part for i in range(5)), part
        assert b"end%d" % n in part and part.endswith(b"0\r\n\r\n")
        assert b"r%d-" % (1 - n) not in part, part
    assert log == [False], log


def test_a_streams_chunks_go_through_its_writer_and_the_bytes_are_those_send_makes() -> None:
    """Where the server offers a BodyWriter, a plain stream's middle chunks are written by it
    (only its head, an empty chunk, which `send` skips and a write would make the body's end,
    and its last chunk pass the ASGI `send`); the client reads the chunks `send` would have
    written."""
    messages: list[str] = []

    async def content() -> AsyncIterator[bytes]:
        for part in (b"one;", b"", "two;", b"three;"):
            yield part
        yield LastChunk(b"end")

    async def app(scope: dict, receive: Any, send: Any) -> None:  # type: ignore[type-arg]
        async def counted(message: dict) -> None:  # type: ignore[type-arg]
            messages.append(message["type"])
            await send(message)
        await EventStream(content())(scope, receive, counted)

    with _serving(HttpLimits(idle_timeout_s=30), app) as port, \
            socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(_post_head(0))
        data = b""
        while not data.endswith(b"0\r\n\r\n"):
            part = s.recv(65536)
            assert part, data
            data += part
    body = data.split(b"\r\n\r\n", 1)[1]
    assert body == b"4\r\none;\r\n4\r\ntwo;\r\n6\r\nthree;\r\n3\r\nend\r\n0\r\n\r\n", body
    assert messages == ["http.response.start", "http.response.body", "http.response.body"], \
        messages
