"""Nothing read before authentication: the ASGI gate in front of a worker's app.

FastAPI reads a route's whole body before its dependencies run, so the app-wide authorizer
(`app._authorizer`, which checks the signature over the body) alone lets anyone make a worker
hold an unbounded body. The gate runs first and decides on the headers:

    open path (challenge, /health) or no token  -> the app, untouched
    Bearer <the token>                           -> the app, untouched (local tools)
    KvpoolHMAC head in its window, for this start -> body read here, at most MAX_CALL_BODY_BYTES
                                                    within CALL_BODY_DEADLINE_S, then replayed
                                                    to the app, which checks the signature
    anything else                                -> 401 at once; no body byte is read

So a caller without the token costs a worker at most one capped body, for a short while.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from kvpool.engine.worker import auth
from kvpool.errors import AuthError
from kvpool.log import RateLimitedLog, get_logger
from kvpool.metadata.http_serving import asgi_header, bearer_matches

log = get_logger("engine.worker.gate")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

MAX_CALL_BODY_BYTES = 8 << 20
"""The largest body of a signed call: a /generate of a 128k-token prompt with its resumed
output is under 2 MiB of JSON."""
CALL_BODY_DEADLINE_S = 10.0
"""A signed call's body must be in within this long (a trickled body holds nothing long)."""


@dataclass(frozen=True)
class GateIdentity:
    """What the gate checks a call against: the cluster token and this worker's address."""

    token: str | None
    host: str
    port: int
    incarnation: str
    """This start of the worker (auth.py): calls signed for another are refused unread."""


class PreAuthGate:
    """ASGI middleware: `identity()` is read per call (the port is known only once bound)."""

    def __init__(self, app: App, identity: Callable[[], GateIdentity],
                 now: Callable[[], float], open_paths: tuple[str, ...]) -> None:
        self.app, self.identity, self.now, self.open_paths = app, identity, now, open_paths
        self.refusals = RateLimitedLog(log, 5.0)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        ident = self.identity()
        if scope["type"] != "http" or scope["path"] in self.open_paths or not ident.token:
            return await self.app(scope, receive, send)
        header = asgi_header(scope, b"authorization")
        if bearer_matches(header, ident.token):
            return await self.app(scope, receive, send)
        try:
            auth.check_signed_head(header, ident.host, ident.port, self.now(),
                                   incarnation=ident.incarnation)
        except AuthError as exc:
            self.refusals.warn("refused a call to %s before its body: %s", scope["path"], exc)
            return await _reply(send, 401, "missing or wrong bearer token",
                                "authentication_error")
        declared = asgi_header(scope, b"content-length")
        if declared.isdigit() and int(declared) > MAX_CALL_BODY_BYTES:
            return await _too_large(send)
        try:
            async with asyncio.timeout(CALL_BODY_DEADLINE_S):
                body = await _read_capped(receive)
        except TimeoutError:
            return await _reply(send, 408, "the body took too long", "invalid_request_error")
        if body is None:
            return await _too_large(send)
        await self.app(scope, _replay(body, receive), send)


async def _read_capped(receive: Receive) -> bytes | None:
    """The whole body, or None as soon as it exceeds MAX_CALL_BODY_BYTES."""
    parts, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise TimeoutError("client gone")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_CALL_BODY_BYTES:
            return None
        parts.append(chunk)
        if not message.get("more_body", False):
            return b"".join(parts)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that hands the app the body read already, then the client's later events."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replayed


async def _too_large(send: Send) -> None:
    await _reply(send, 413, f"a signed call's body is limited to {MAX_CALL_BODY_BYTES} bytes",
                 "invalid_request_error")


async def _reply(send: Send, status: int, message: str, kind: str) -> None:
    body = json.dumps({"error": {"message": message, "type": kind}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})
