"""The proxy's front door: the two completion endpoints answered without FastAPI's routing
(`metadata/http_front.py`), their streams as `EventStream`s.

The completion endpoints need none of FastAPI's layers: their handler parses the body itself,
bounds it, and turns every error into an OpenAI error body (docs/serve.md, "The proxy's own
cost"). The API-key gate stays outside (`ApiKeyGate(front_door(...))`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from kvpool.metadata.http_front import FastRoutes

KINDS = {"/v1/completions": "completion", "/v1/chat/completions": "chat"}
"""Path -> the kind of request `serve` gets."""

Serve = Callable[[Request, str], Awaitable[Response]]


def front_door(app: Any, serve: Serve) -> FastRoutes:
    """POST /v1/completions and /v1/chat/completions straight to `serve(request, kind)`;
    every other request (and the lifespan) to `app` (its routes, 404/405 in OpenAI shape)."""

    def route(kind: str) -> Callable[[Request], Awaitable[Response]]:
        return lambda request: serve(request, kind)

    return FastRoutes(app, {("POST", path): route(kind) for path, kind in KINDS.items()})
