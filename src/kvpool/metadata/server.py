"""The HTTP metadata server, wire-compatible with Mooncake's: `GET|PUT|DELETE /metadata?key=K`.

    GET    -> 200 + raw value bytes | 404 absent
    PUT    -> 200 (raw request body stored verbatim) | 413 value too large
              | 507 the values would exceed the total quota
    DELETE -> 200 | 404 absent
    PUT, DELETE -> 503 when a durable store (--state-file) cannot log the change
    PUT, DELETE -> 401 without `Authorization: Bearer <token>` when the server has a token
    any    -> 400 when `key` is missing, blank, or longer than the limit

Reads stay open: descriptors say where segments listen, and peers need them before they can
authenticate anywhere. Bytes being received count against the quota as they arrive, so
concurrent uploads cannot hold more than `max_total_bytes` between them either.

`create_metadata_app` builds the FastAPI app (the store master mounts it on its own port);
`MetadataServer` runs it with uvicorn on a background thread, or in the foreground for the CLI.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType, TracebackType

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response

from kvpool.errors import ConfigError, MetadataError
from kvpool.log import get_logger
from kvpool.metadata.base import (
    DEFAULT_MAX_KEY_LEN,
    DEFAULT_MAX_TOTAL_BYTES,
    DEFAULT_MAX_VALUE_BYTES,
)
from kvpool.metadata.http_serving import HttpLimits, QuietServer, bearer_matches, uvicorn_config
from kvpool.metadata.memory import MemoryBackend

METADATA_PATH = "/metadata"
DEFAULT_PORT = 8080
_STARTUP_TIMEOUT_S = 15.0
_log = get_logger("metadata.server")


@dataclass(frozen=True)
class MetadataLimits:
    """What one request may carry."""

    max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES
    """Largest PUT body accepted; larger ones get 413."""
    max_key_len: int = DEFAULT_MAX_KEY_LEN
    """Longest key, in characters; longer ones get 400."""
    max_total_bytes: int = DEFAULT_MAX_TOTAL_BYTES
    """All stored values together (plus bodies being received); a PUT beyond gets 507."""

    def __post_init__(self) -> None:
        if not 1 <= self.max_value_bytes <= 1 << 31:
            raise ConfigError(f"max_value_bytes must be in [1, 2 GiB], got {self.max_value_bytes}")
        if not 1 <= self.max_key_len <= 65536:
            raise ConfigError(f"max_key_len must be in [1, 65536], got {self.max_key_len}")
        if not self.max_value_bytes <= self.max_total_bytes <= 1 << 40:
            raise ConfigError(f"max_total_bytes must be in [max_value_bytes, 1 TiB], got "
                              f"{self.max_total_bytes}")


def create_metadata_app(
    backend: MemoryBackend | None = None, limits: MetadataLimits | None = None,
    token: str | None = None,
) -> FastAPI:
    """A FastAPI app serving `METADATA_PATH` over `backend` (a fresh MemoryBackend if None);
    with `token`, writes need it as a Bearer credential."""
    store = backend if backend is not None else MemoryBackend()
    limit = limits or MetadataLimits()
    budget = _WriteBudget(store, limit.max_total_bytes)
    app = FastAPI(title="kvpool metadata", openapi_url=None, docs_url=None, redoc_url=None)
    app.state.metadata_backend = store

    @app.get(METADATA_PATH)
    def get_value(request: Request) -> Response:
        key = _key_of(request, limit)
        if isinstance(key, Response):
            return key
        value = store.get(key)
        if value is None:
            return _text(404, f"metadata not found: {key!r}")
        return Response(value, media_type="application/octet-stream")

    @app.put(METADATA_PATH)
    async def put_value(request: Request) -> Response:
        refusal = _unauthorized(request, token)
        key = _key_of(request, limit) if refusal is None else refusal
        if isinstance(key, Response):
            return key
        return await budget.receive_and_store(request, key, limit.max_value_bytes)

    @app.delete(METADATA_PATH)
    def delete_value(request: Request) -> Response:
        refusal = _unauthorized(request, token)
        key = _key_of(request, limit) if refusal is None else refusal
        if isinstance(key, Response):
            return key
        try:
            deleted = store.delete(key)
        except MetadataError as exc:
            return _text(503, f"metadata not deleted: {exc}")
        if not deleted:
            return _text(404, f"metadata not found: {key!r}")
        return _text(200, "metadata deleted")

    return app


def _unauthorized(request: Request, token: str | None) -> Response | None:
    """401 unless the request carries `token` (when there is one)."""
    if token is None or bearer_matches(request.headers.get("authorization"), token):
        return None
    response = _closing(_text(401, "metadata writes need the shared token: send "
                                   "'Authorization: Bearer <token>' (KVPOOL_TOKEN)"))
    response.headers["www-authenticate"] = "Bearer"
    return response


class _WriteBudget:
    """Stored bytes plus bytes being received stay within `max_total_bytes`. Used from the
    event loop only (the PUT handler is async), so reservations need no lock."""

    def __init__(self, store: MemoryBackend, max_total_bytes: int) -> None:
        self._store = store
        self._max_total_bytes = max_total_bytes
        self._receiving = 0

    async def receive_and_store(self, request: Request, key: str, max_value_bytes: int
                                ) -> Response:
        old = self._store.get(key)
        credit = len(old) if old is not None else 0
        held = 0
        try:
            chunks: list[bytes] = []
            declared = request.headers.get("content-length")
            if declared is not None and declared.isdigit() and int(declared) > max_value_bytes:
                return _too_large(f"{declared} bytes", max_value_bytes)
            async for chunk in request.stream():
                if held + len(chunk) > max_value_bytes:
                    return _too_large(f"more than {max_value_bytes} bytes", max_value_bytes)
                if not self._reserve(len(chunk), credit):
                    return self._over_quota()
                held += len(chunk)
                chunks.append(chunk)
            try:
                value = b"".join(chunks)
                # off the event loop when it waits on I/O: a durable store's fsync or etcd
                # round trip (seconds while etcd is down) must not hold up the GETs it
                # serves from memory (meanwhile the quota may count the value twice)
                stored = await asyncio.to_thread(
                    self._store.put_within, key, value, self._max_total_bytes) \
                    if self._store.writes_block else \
                    self._store.put_within(key, value, self._max_total_bytes)
            except MetadataError as exc:   # a durable store could not log the change
                return _text(503, f"metadata not stored: {exc}")
            if not stored:
                return self._over_quota()
            return _text(200, "metadata updated")
        finally:
            self._receiving -= held

    def _reserve(self, num_bytes: int, credit: int) -> bool:
        total = self._store.total_bytes - credit + self._receiving + num_bytes
        if total > self._max_total_bytes:
            return False
        self._receiving += num_bytes
        return True

    def _over_quota(self) -> Response:
        return _closing(_text(507, f"metadata store is full: values may total "
                                   f"{self._max_total_bytes} bytes; delete stale keys or raise "
                                   "--max-total-size"))


def _text(status: int, message: str) -> PlainTextResponse:
    return PlainTextResponse(message + "\n", status_code=status)


def _key_of(request: Request, limits: MetadataLimits) -> str | Response:
    key = request.query_params.get("key")
    if key is None or not key.strip():
        return _text(400, "missing or blank 'key' query parameter: use /metadata?key=NAME")
    if len(key) > limits.max_key_len:
        return _text(400, f"key of {len(key)} characters exceeds the limit of {limits.max_key_len}")
    return key


def _too_large(size: str, max_bytes: int) -> Response:
    return _closing(_text(413, f"value of {size} exceeds the limit of {max_bytes} bytes"))


def _closing(response: Response) -> Response:
    response.headers["connection"] = "close"  # the unread rest of the body is not wanted
    return response


class MetadataServer:
    """Serves the metadata app with uvicorn on host:port (port 0 picks a free port).

    `start()` returns once the socket accepts connections and uvicorn is running; `.port` is
    then the real port. `stop()` is idempotent. `serve_forever()` blocks until SIGINT/SIGTERM.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = DEFAULT_PORT,
        *,
        backend: MemoryBackend | None = None,
        limits: MetadataLimits | None = None,
        http_limits: HttpLimits | None = None,
        token: str | None = None,
    ) -> None:
        if not 0 <= port <= 65535:
            raise ConfigError(f"metadata server port must be in 0..65535, got {port}")
        self.host = host
        self.port = port
        self.backend = backend if backend is not None else MemoryBackend()
        self.http_limits = http_limits or HttpLimits()
        self.app = create_metadata_app(self.backend, limits, token)
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._socket: socket.socket | None = None

    @property
    def url(self) -> str:
        """The URI clients pass to connect_metadata."""
        return f"http://{self.host}:{self.port}{METADATA_PATH}"

    def start(self) -> MetadataServer:
        if self._thread is not None:
            raise MetadataError(f"metadata server on {self.host}:{self.port} already started")
        self._socket = self._listen()
        config = uvicorn_config(self.app, self.http_limits, timeout_graceful_shutdown=2)
        self._server = QuietServer(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._socket]},
            name=f"metadata-http-{self.port}", daemon=True,
        )
        self._thread.start()
        self._wait_started()
        _log.info("metadata server listening on %s", self.url)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(10.0)
        if self._socket is not None:
            self._socket.close()
        self._server = self._thread = self._socket = None

    def serve_forever(self, on_ready: Callable[[MetadataServer], None] | None = None) -> None:
        """Start, call `on_ready(self)`, and run until SIGINT or SIGTERM (main thread only)."""
        stop_requested = threading.Event()

        def on_signal(signum: int, frame: FrameType | None) -> None:
            _log.info("metadata server got signal %d, stopping", signum)
            stop_requested.set()

        previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            self.start()
            if on_ready is not None:
                on_ready(self)
            while not stop_requested.wait(0.5):
                if self._thread is None or not self._thread.is_alive():
                    raise MetadataError(f"metadata server on {self.url} died")
        finally:
            self.stop()
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def __enter__(self) -> MetadataServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _listen(self) -> socket.socket:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        # proto must be IPPROTO_TCP: asyncio only disables Nagle on accepted sockets that say
        # so, and with Nagle on, each response pays a 40 ms delayed-ACK stall.
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.port))
            sock.listen(128)
        except OSError as exc:
            sock.close()
            raise MetadataError(
                f"metadata server cannot listen on {self.host}:{self.port}: {exc}"
            ) from exc
        self.port = int(sock.getsockname()[1])
        return sock

    def _wait_started(self) -> None:
        assert self._server is not None and self._thread is not None
        deadline = time.monotonic() + _STARTUP_TIMEOUT_S
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise MetadataError(f"metadata server on {self.host}:{self.port} failed to start")
            time.sleep(0.01)
