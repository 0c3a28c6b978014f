"""The worker's HTTP API (docs/worker-api.md) over a `Worker`."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.requests import ClientDisconnect

from kvpool.engine.core import StepOutput
from kvpool.engine.worker import auth
from kvpool.engine.worker import metrics as worker_metrics
from kvpool.engine.worker.auth import CHALLENGE_PATH
from kvpool.engine.worker.frames import FrameBuilder
from kvpool.engine.worker.gate import GateIdentity, PreAuthGate
from kvpool.engine.worker.messages import (
    AbortReply,
    AbortRequest,
    ErrorLine,
    GenerateRequest,
    InfoReply,
    LoadReply,
    PrefillReply,
    PrefillRequest,
    ReserveReply,
    ReserveRequest,
    ndjson_line,
)
from kvpool.engine.worker.runtime import Worker
from kvpool.engine.worker.sse_text import SseText
from kvpool.errors import (
    AuthError,
    InvalidArgument,
    KvpoolError,
    RemoteProtocolError,
    RequestFailed,
    ShuttingDown,
)
from kvpool.log import RateLimitedLog, get_logger
from kvpool.metadata.http_front import EventStream, FastRoutes, LastChunk
from kvpool.metadata.http_serving import bearer_matches, read_body

log = get_logger("engine.worker.http")


OPEN_PATHS = (CHALLENGE_PATH, "/health")
"""Answered without the token: the challenge (proves the token, never takes it) and the
liveness probe (a role, nothing else)."""


def error(status: int, message: str, kind: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind}}, status_code=status)


def _target(request: Request) -> str:
    """path?query as the client sent it (what a signed call covers)."""
    query = request.scope.get("query_string", b"").decode("latin-1")
    return request.scope["path"] + (f"?{query}" if query else "")


def _authorizer(worker: Worker, now: Callable[[], float]) -> Callable[[Request], Any]:
    """The app-wide dependency that admits a call: the token as a bearer (local tools) or a
    call signed with it (the proxy); the challenge and /health are open."""
    seen = auth.SeenNonces()
    refusals = RateLimitedLog(log, 5.0)

    async def authorized(request: Request) -> None:
        token = worker.config.token
        if request.url.path in OPEN_PATHS or not token:
            return
        header = request.headers.get("authorization") or ""
        if header.startswith(auth.SCHEME + " "):
            try:
                auth.check_signed(token, header, request.method, _target(request),
                                  await request.body(), worker.config.host,
                                  worker.config.port, now(), seen, incarnation=worker.epoch)
                return
            except AuthError as exc:
                refusals.warn("refused a signed call to %s: %s", request.url.path, exc)
                raise _Unauthorized() from None
        if not bearer_matches(header, token):
            raise _Unauthorized()

    return authorized


def create_app(worker: Worker, now: Callable[[], float] = time.time) -> PreAuthGate:
    """`now`: wall-clock seconds, for the time window of signed calls. The gate, then POST
    /generate straight to its handler (`http_front.FastRoutes`: the route every token of a
    request passes), then FastAPI's routes for the rest (and the lifespan)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await worker.ready_text()  # before /info can say whether it makes SSE text
        yield
        await worker.close()

    authorized = _authorizer(worker, now)
    app = FastAPI(title=f"kvpool worker ({worker.config.role})", lifespan=lifespan,
                  dependencies=[Depends(authorized)])
    _add_error_handlers(app)
    _add_open_routes(app, worker)
    _add_state_routes(app, worker)
    _add_request_routes(app, worker)
    routes = FastRoutes(app, {("POST", "/generate"): _generate_route(worker, authorized)})
    return PreAuthGate(routes, now=now, open_paths=OPEN_PATHS, identity=lambda: GateIdentity(
        worker.config.token, worker.config.host, worker.config.port, worker.epoch))


def error_reply(exc: BaseException) -> JSONResponse | None:
    """The error body of what a route raised, as its status and error type; None for what
    is not one of these (a 500)."""
    if isinstance(exc, _Unauthorized):
        return error(401, "missing or wrong bearer token", "authentication_error")
    if isinstance(exc, ClientDisconnect):
        return error(400, "the client went away before its body was in", "invalid_request_error")
    if isinstance(exc, RequestValidationError | ValidationError):
        return error(400, str(exc.errors()[:3]), "invalid_request_error")
    if isinstance(exc, ShuttingDown):
        return error(503, str(exc), "unavailable")
    if isinstance(exc, RequestFailed):
        return error(502, str(exc), "request_failed")
    if isinstance(exc, KvpoolError | _WrongRole):
        return error(400, str(exc), "invalid_request_error")
    return None


def _add_error_handlers(app: FastAPI) -> None:
    """Each error a route raises, as `error_reply` answers it."""

    async def handler(_: Request, exc: Exception) -> JSONResponse:
        reply = error_reply(exc)
        assert reply is not None  # registered only for the kinds it answers
        return reply

    for kind in (_Unauthorized, RequestValidationError, KvpoolError, _WrongRole):
        app.add_exception_handler(kind, handler)


def _add_open_routes(app: FastAPI, worker: Worker) -> None:
    """The routes answered without the token (OPEN_PATHS): the challenge and /health."""
    role = worker.config.role

    @app.post(CHALLENGE_PATH)
    async def challenge(request: Request) -> JSONResponse:
        try:
            body = json.loads(await read_body(request, 4096, 10.0))
            c = worker.config
            return JSONResponse(auth.answer(c.token, c.host, c.port, body,
                                             incarnation=worker.epoch))
        except (ValueError, RemoteProtocolError, TimeoutError) as exc:
            return error(400, f"bad challenge: {exc}", "invalid_request_error")
        except AuthError as exc:
            return error(403, str(exc), "authentication_error")

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"ok": True, "role": role}


def _add_state_routes(app: FastAPI, worker: Worker) -> None:
    """What the worker is and holds: /info, /load, /metrics."""

    @app.get("/info")
    async def info() -> InfoReply:
        return worker.info()

    @app.get("/load", response_model_exclude_none=True)  # block_hashes or block_events
    async def load(epoch: str = "", since: int | None = None) -> LoadReply:
        return await worker.load(epoch, since)

    @app.get("/metrics")
    async def metrics() -> Response:
        values = worker_metrics.counters(worker.connector, worker.store)
        return Response(worker_metrics.render(values), media_type=worker_metrics.CONTENT_TYPE)


def _add_request_routes(app: FastAPI, worker: Worker) -> None:
    """The legs of a request (each refused by a worker of the wrong role) and their abort."""
    needs = _role_check(worker.config.role)

    @app.post("/prefill")
    async def prefill(body: PrefillRequest) -> PrefillReply:
        needs("prefill", "both")
        return await worker.prefill(body)

    @app.post("/generate")  # answered by _generate_route; here for 405s and the docs
    async def generate(body: GenerateRequest) -> Response:
        return await _generate_stream(worker, needs, body)

    @app.post("/kv/reserve", response_model=None)
    async def reserve(body: ReserveRequest) -> ReserveReply | JSONResponse:
        needs("decode", "both")
        reply = await worker.reserve(body)
        if reply is None:
            return error(503, f"no room for {body.num_tokens} tokens of KV", "out_of_kv_space")
        return reply

    @app.post("/abort")
    async def abort(body: AbortRequest) -> AbortReply:
        return AbortReply(ok=await worker.abort(body.request_id))


def _generate_route(worker: Worker, authorized: Callable[[Request], Awaitable[None]]
                    ) -> Callable[[Request], Awaitable[Response]]:
    """POST /generate without FastAPI's layers: the same checks (the token, the role, the
    body) and the same error bodies as its routes."""
    needs = _role_check(worker.config.role)

    async def generate(request: Request) -> Response:
        try:
            await authorized(request)
            _check_json(request.headers.get("content-type"))
            body = GenerateRequest.model_validate_json(await request.body())
            return await _generate_stream(worker, needs, body)
        except Exception as exc:
            reply = error_reply(exc)
            if reply is None:
                raise
            return reply

    return generate


def _check_json(content_type: str | None) -> None:
    """A body typed as anything but JSON is refused, as FastAPI's routes refuse it (none
    given: read as JSON). A browser's cross-site form post (text/plain) cannot start a
    request on a worker that runs without a token."""
    if content_type is None:
        return
    kind = content_type.split(";", 1)[0].strip().lower()
    if kind != "application/json" and not (kind.startswith("application/")
                                           and kind.endswith("+json")):
        raise InvalidArgument(f"the body must be application/json, not {kind or 'empty'}")


async def _generate_stream(worker: Worker, needs: Callable[..., None],
                           body: GenerateRequest) -> Response:
    """The request's NDJSON stream (`ndjson`); a client that goes away ends it, and with it
    the request."""
    needs("decode", "both")
    interval = body.stream_interval or worker.config.stream_interval
    text = await worker.sse_text(body)
    outputs = worker.generate(body)
    return EventStream(ndjson(outputs, interval, text),
                       media_type="application/x-ndjson")


def _role_check(role: str) -> Callable[..., None]:
    """`needs(*roles)`: raises _WrongRole (a 400) unless this worker's `role` is one of them."""

    def needs(*roles: str) -> None:
        if role not in roles:
            raise _WrongRole(f"this is a {role} worker; the call needs {' or '.join(roles)}")

    return needs


class _Unauthorized(Exception):
    pass


class _WrongRole(Exception):
    pass


async def ndjson(outputs: AsyncGenerator[list[StepOutput]], interval: int = 1,
                 text: SseText | None = None) -> AsyncIterator[bytes]:
    """The frames of the outputs (engine/worker/frames.py), then the finish line; an error
    ends the stream with its line. All the lines one step makes are written at once. A stream
    that a stop string ended stops reading `outputs`, which aborts the request."""
    frames = FrameBuilder(interval, text)
    try:
        async with contextlib.aclosing(outputs):
            async for outs in outputs:
                lines = frames.add(outs)
                data = ndjson_line(lines[0]) if len(lines) == 1 else \
                    b"".join(ndjson_line(msg) for msg in lines)  # one line: most steps
                if frames.done:  # with the end of the body, in one write
                    yield LastChunk(data)
                    return
                if data:
                    yield data
    except KvpoolError as exc:
        yield LastChunk(ndjson_line(ErrorLine(error=str(exc))))
    except Exception as exc:
        log.exception("generate failed")
        yield LastChunk(ndjson_line(ErrorLine(error=f"{type(exc).__name__}: {exc}")))

