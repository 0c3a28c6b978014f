"""The proxy's front door: the two completion endpoints answered without FastAPI's routing,
and a streamed response without starlette's task group.

    FrontDoor(app, serve)   ASGI: POST /v1/completions and /v1/chat/completions go straight
                            to `serve(request, kind)`; every other request (and the lifespan)
                            to `app` (the FastAPI app: its routes, 404/405 in OpenAI shape)
    EventStream(events)     a StreamingResponse whose client going away cancels the stream
                            (one watcher task, not an anyio task group with two)

FastAPI's layers (its error, telemetry, body-limit and exit-stack middleware, the router, the
dependency solver) cost about as much per request as the rest of the request's own Python
before its first token (docs/serve.md, "The proxy's own cost"); the completion endpoints need
none of them: their handler parses the body itself, bounds it, and turns every error into an
OpenAI error body. The API-key gate stays outside both (`ApiKeyGate(FrontDoor(...))`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

KINDS = {"/v1/completions": "completion", "/v1/chat/completions": "chat"}
"""Path -> the kind of request `serve` gets."""

Serve = Callable[[Request, str], Awaitable[Response]]


class FrontDoor:
    def __init__(self, app: Any, serve: Serve) -> None:
        self.app, self.serve = app, serve

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        kind = KINDS.get(scope["path"]) if scope["type"] == "http" and \
            scope["method"] == "POST" else None
        if kind is None:
            await self.app(scope, receive, send)
            return
        response = await self.serve(Request(scope, receive), kind)
        await response(scope, receive, send)


class EventStream(StreamingResponse):
    """A streamed response that ends when its client goes away: a watcher task reads the
    ASGI disconnect and cancels the task that streams (its generators then close, and with
    them the request on the workers), which returns quietly, as starlette's would.
    `on_close(client_gone)` is called once however it ends (the access line)."""

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
