"""The hot routes of the servers on the per-token path (the proxy, the workers), answered
without FastAPI's routing, and their streams without starlette's task group.

    FastRoutes(app, routes)   ASGI: a request whose (method, path) is in `routes` goes
                              straight to its handler (Request -> Response); every other
                              request (and the lifespan) to `app` (the FastAPI app)
    EventStream(content)      a StreamingResponse whose client going away cancels the stream
                              (told by the server's connection loss where it offers a
                              BodyWriter, else one watcher task; not an anyio task group
                              with two); with
                              `coalesce`, the chunks made while the stream was not waiting
                              go out in one write (`Outbox`)
    LastChunk(data)           a stream's last bytes: the end of the body goes out with them,
                              in one write (uvicorn writes an empty end of its own otherwise)
    EventStream(..., on_writer=f)  f(the request's BodyWriter) once the head is sent, where the
                              server offers one: the content's maker may then write chunks
                              itself while the stream waits for its next one

FastAPI's layers (its error, telemetry, body-limit and exit-stack middleware, the router, the
dependency solver) cost about as much per request as the rest of a short request's own
Python, and each chunk of a stream passes two of their send wrappers; a hot route's handler
parses its body itself and turns every error into the body the app's handlers would give.

A relay that falls behind its source reads several frames at once (at 32 streams, about six
per read of a worker's stream), and wrote each one's chunk with a send of its own: a third of
the proxy's CPU. nginx writes what one read brought in one write. With `coalesce` the stream is
made by a task of its own into an `Outbox`, and the response's task writes whatever is in it
when it wakes: the same bytes, in as many writes as the maker stopped to wait.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, Awaitable, Callable, Mapping
from typing import Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from kvpool.log import get_logger
from kvpool.metadata.http_serving import BODY_WRITER, BodyWriter

log = get_logger("http.front")

Handler = Callable[[Request], Awaitable[Response]]


class FastRoutes:
    def __init__(self, app: Any, routes: Mapping[tuple[str, str], Handler]) -> None:
        self.app, self.routes = app, dict(routes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        handler = self.routes.get((scope["method"], scope["path"])) \
            if scope["type"] == "http" else None
        if handler is None:
            await self.app(scope, receive, send)
            return
        response = await handler(Request(scope, receive))
        await response(scope, receive, send)


class LastChunk(bytes):
    """The last bytes of an `EventStream`'s content: sent as the end of the body (the chunked
    encoding's end in the same write), and the content is closed without being read on."""


class EventStream(StreamingResponse):
    """A streamed response that ends when its client goes away: a watcher task reads the
    ASGI disconnect and cancels the task that streams (its generators then close, and with
    them whatever they drive), which returns quietly, as starlette's would.
    `on_close(client_gone)` is called once however it ends."""

    def __init__(self, content: Any, on_close: Callable[[bool], None] | None = None,
                 coalesce: bool = False, on_writer: Callable[[BodyWriter], None] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.on_close = on_close
        self.coalesce = coalesce
        self.on_writer = on_writer
        """Given the request's `BodyWriter` once the head is sent (where the server offers
        one, and not with `coalesce`): the content's maker may write chunks itself then,
        while the stream waits for its next chunk."""
        self._extensions: dict[str, Any] = {}
        self.complete = False
        """The body has ended: the disconnect that follows is no client gone (the content
        may still be closing)."""

    async def stream_response(self, send: Send) -> None:
        if not self.coalesce:
            try:
                await self._stream_each(send)
            finally:  # however it ends (a cancel inside `send` too), the content is closed now
                aclose = getattr(self.body_iterator, "aclose", None)
                if aclose is not None:
                    await aclose()
            return
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        outbox = Outbox()
        maker = asyncio.ensure_future(outbox.fill(self.body_iterator))
        try:
            while (data := await outbox.take()) is not None:
                await send({"type": "http.response.body", "body": data, "more_body": True})
        finally:
            outbox.stop(maker)  # if it still runs: the stream's generators close
            await asyncio.wait([maker])
        self.complete = True
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _stream_each(self, send: Send) -> None:
        """A send per chunk; a `LastChunk` ends the body."""
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        writer = self._extensions.get(BODY_WRITER)
        if self.on_writer is not None and writer is not None:
            self.on_writer(writer)
        async for data in self.body_iterator:
            last = isinstance(data, LastChunk)
            if not isinstance(data, bytes | memoryview):
                data = data.encode(self.charset)
            if not last and data and writer is not None and writer.ready():
                writer.write(data)  # what `send` would write, without its layers
                continue
            self.complete = last
            await send({"type": "http.response.body", "body": data, "more_body": not last})
            if last:
                return
        self.complete = True
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        self._extensions = scope.get("extensions") or {}
        task = asyncio.current_task()
        assert task is not None
        gone = _Gone(task, self)
        writer: BodyWriter | None = self._extensions.get(BODY_WRITER)
        stop = writer.watch_disconnect(gone) if writer is not None \
            else _watch_receive(receive, gone)
        cancelled = False
        try:
            await self.stream_response(send)
        except asyncio.CancelledError:
            cancelled = True
            if not gone.fired or task.uncancel() > 0:
                raise  # cancelled from elsewhere (the server shutting down)
        finally:
            stop()
            if self.on_close is not None:
                self.on_close(cancelled)
        if self.background is not None:
            await self.background()


OUTBOX_BYTES = 1 << 18
"""What an outbox holds before its maker waits for the writer (a slow client)."""


class Outbox:
    """Chunks from a stream's maker to its writer: `take` returns all that came since the
    last `take` (waiting for at least one), None once the stream has ended, or raises what
    ended it (after the chunks made before). The maker waits while `limit` bytes wait, so a
    slow client still holds back its source."""

    def __init__(self, limit: int = OUTBOX_BYTES) -> None:
        self.limit = limit
        self._chunks: list[bytes] = []
        self._size = 0
        self._ended = False
        self._stopping = False
        self._error: BaseException | None = None
        self._ready = asyncio.Event()
        self._room = asyncio.Event()
        self._room.set()

    async def fill(self, content: AsyncIterable[bytes | str | memoryview]) -> None:
        """The maker: every chunk of `content` (str encoded as UTF-8). However it ends, the
        content is closed (an async generator's `finally` blocks run here, not at a later
        collection). What ends it, unless the writer did (`stop`), the writer raises, a
        CancelledError from inside the content too."""
        try:
            async for chunk in content:
                data = chunk.encode() if isinstance(chunk, str) else bytes(chunk)
                self._chunks.append(data)
                self._size += len(data)
                self._ready.set()
                if self._size >= self.limit:
                    self._room.clear()
                    await self._room.wait()
        except asyncio.CancelledError as exc:
            if self._stopping:
                raise
            self._error = exc
        except Exception as exc:
            self._failed(exc)
        finally:
            self._ended = True
            self._ready.set()
            await self._close(content)

    def _failed(self, exc: Exception) -> None:
        if self._stopping:  # nobody reads it any more
            log.warning("a stream's content failed after its writer stopped: %r", exc)
        else:
            self._error = exc

    async def _close(self, content: object) -> None:
        aclose = getattr(content, "aclose", None)
        if aclose is None:
            return
        try:
            await aclose()
        except Exception as exc:
            self._failed(exc)

    def stop(self, maker: asyncio.Future[None]) -> None:
        """The writer is done (its client gone, or cancelled): cancel the maker."""
        self._stopping = True
        if not maker.done():
            maker.cancel()

    async def take(self) -> bytes | None:
        while not self._chunks:
            if self._ended:
                if self._error is not None:
                    raise self._error
                return None
            self._ready.clear()
            await self._ready.wait()
        data = b"".join(self._chunks)
        self._chunks.clear()
        self._size = 0
        self._room.set()
        return data


class _Gone:
    """Told that the client went: cancels the streaming task unless the body had ended."""

    __slots__ = ("_task", "_stream", "fired")

    def __init__(self, task: asyncio.Task[Any], stream: EventStream) -> None:
        self._task, self._stream = task, stream
        self.fired = False
        """The task was cancelled for the client's going."""

    def __call__(self) -> None:
        if not self._stream.complete:
            self.fired = True
            self._task.cancel()


def _watch_receive(receive: Any, gone: _Gone) -> Callable[[], None]:
    """Where the server offers no `BodyWriter` (h11): a task reads the ASGI disconnect and
    tells `gone`; returns what stops it."""
    watcher = asyncio.ensure_future(_disconnect(receive))
    watcher.add_done_callback(lambda f: None if f.cancelled() else gone())

    def stop() -> None:
        watcher.cancel()
    return stop


async def _disconnect(receive: Any) -> None:
    """Returns at the client's disconnect (the body was read already, so the next ASGI
    message is the disconnect)."""
    while (await receive())["type"] != "http.disconnect":
        pass
