"""The hot routes of the servers on the per-token path (the proxy, the workers), answered
without FastAPI's routing, and their streams without starlette's task group.

    FastRoutes(app, routes)   ASGI: a request whose (method, path) is in `routes` goes
                              straight to its handler (Request -> Response); every other
                              request (and the lifespan) to `app` (the FastAPI app)
    EventStream(content)      a StreamingResponse whose client going away cancels the stream
                              (one watcher task, not an anyio task group with two)

FastAPI's layers (its error, telemetry, body-limit and exit-stack middleware, the router, the
dependency solver) cost about as much per request as the rest of a short request's own
Python, and each chunk of a stream passes two of their send wrappers; a hot route's handler
parses its body itself and turns every error into the body the app's handlers would give.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

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


class EventStream(StreamingResponse):
    """A streamed response that ends when its client goes away: a watcher task reads the
    ASGI disconnect and cancels the task that streams (its generators then close, and with
    them whatever they drive), which returns quietly, as starlette's would.
    `on_close(client_gone)` is called once however it ends."""

    def __init__(self, content: Any, on_close: Callable[[bool], None] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        task = asyncio.current_task()
        assert task is not None
        gone = asyncio.ensure_future(_disconnect(receive))
        gone.add_done_callback(lambda f: None if f.cancelled() else task.cancel())
        cancelled = False
        try:
            await self.stream_response(send)
        except asyncio.CancelledError:
            cancelled = True
            if not gone.done() or gone.cancelled() or task.uncancel() > 0:
                raise  # cancelled from elsewhere (the server shutting down)
        finally:
            gone.cancel()
            if self.on_close is not None:
                self.on_close(cancelled)
        if self.background is not None:
            await self.background()


async def _disconnect(receive: Any) -> None:
    """Returns at the client's disconnect (the body was read already, so the next ASGI
    message is the disconnect)."""
    while (await receive())["type"] != "http.disconnect":
        pass
