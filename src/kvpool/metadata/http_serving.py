"""How kvpool runs its HTTP servers (metadata, master admin) with uvicorn: bounded
concurrency and idle time, shared by every server so that they defend alike.

- `max_concurrency`: connections plus requests in progress; above it uvicorn answers 503,
  but first a new connection closes the one that has waited longest for a request, so
  connections that never send one cannot lock the clients out.
- `head_timeout_s`: a request head that trickles in is cut off after this long.
- `idle_timeout_s`: a keep-alive connection with no new request, and (unlike plain uvicorn)
  a fresh connection that has not sent a byte yet, is closed after this long, so a flood of
  silent connections gives its descriptors back.
- `fast=True` (the proxy and the workers, the servers on the per-token path): uvloop's event
  loop and httptools' parser when they are installed (`fast_stack`), with the same defences
  (they live in a mixin over either protocol class); otherwise, and for every other server,
  asyncio's loop and h11.
- When accept() runs out of descriptors, asyncio rests the listener for a second, but logs
  a traceback for every attempt (a backlog's worth each second); `QuietServer` logs one
  line per interval instead.

Repeated warnings go through `kvpool.log.RateLimitedLog`.
"""

from __future__ import annotations

import asyncio
import gc
import hmac
import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, cast

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

try:  # the proxy's faster parser (a dependency; h11 where it is missing)
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # pragma: no cover - httptools not installed
    HttpToolsProtocol = None  # type: ignore[assignment,misc]

from kvpool.errors import ConfigError, InvalidArgument
from kvpool.log import RateLimitedLog, get_logger
from kvpool.metadata.held_head import HeldHead

LOG_INTERVAL_S = 5.0
_ACCEPT_FAILED = "socket.accept() out of system resource"
_log = get_logger("http")
_evictions = RateLimitedLog(_log, LOG_INTERVAL_S)


@dataclass(frozen=True)
class HttpLimits:
    max_concurrency: int = 256
    """Connections and requests in progress at once; more get 503 Service Unavailable."""
    idle_timeout_s: float = 5.0
    """Close a connection idle this long (before its first request or between requests)."""
    backlog: int = 128
    """Connections the kernel queues before they are accepted."""
    head_timeout_s: float = 10.0
    """A request head (request line and headers) must be in within this long of the accept
    or of the previous response, however slowly it trickles, or the connection is closed."""
    body_idle_s: float = 2.0
    """At the concurrency limit, a connection whose request body has not advanced for this
    long gives way to a new one, like a connection waiting for a head (a trickled body)."""

    def __post_init__(self) -> None:
        if not 1 <= self.max_concurrency <= 1 << 16:
            raise ConfigError(f"max_concurrency must be in [1, 65536], got "
                              f"{self.max_concurrency}")
        if not 0 < self.idle_timeout_s <= 3600:
            raise ConfigError(f"idle_timeout_s must be in (0, 3600], got {self.idle_timeout_s}")
        if not 0 < self.body_idle_s <= 3600:
            raise ConfigError(f"body_idle_s must be in (0, 3600], got {self.body_idle_s}")
        if not 0 < self.head_timeout_s <= 3600:
            raise ConfigError(f"head_timeout_s must be in (0, 3600], got {self.head_timeout_s}")
        if not 1 <= self.backlog <= 65535:
            raise ConfigError(f"backlog must be in [1, 65535], got {self.backlog}")


if TYPE_CHECKING:
    _ProtocolBase = H11Protocol
else:
    _ProtocolBase = object


class _Defences(_ProtocolBase):
    """Mixed into uvicorn's h11 protocol, or its httptools one (both keep `cycle`,
    `connections`, `loop`, `transport` and the keep-alive timer alike): its keep-alive timer
    also running from the moment a connection is accepted (uvicorn starts it only after a first response), a deadline for
    each request head (`head_timeout_s` from the accept or the last response, however the
    head trickles in), and, at the concurrency limit, the connection waiting longest for a
    request closed to make room for a new one."""

    head_timeout_s = 10.0
    body_idle_s = 2.0
    max_concurrency = 256
    hold_heads = False
    """Write each response's head with its body's first bytes (`HeldHead`): for a server
    whose responses' first bytes follow their head at once (the proxy's). Where they do not
    (a worker's stream waits for its engine), it only costs a turn of the loop."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if self.hold_heads:
            transport = HeldHead(transport, self.loop)  # type: ignore[assignment]
        super().connection_made(transport)
        self.data_since = self.loop.time()
        self.timeout_keep_alive_task = self.loop.call_later(
            self.timeout_keep_alive, self.timeout_keep_alive_handler)
        self._head_task: asyncio.TimerHandle | None = None
        self._arm_head_deadline()
        if len(self.connections) >= self.max_concurrency:
            self._evict_waiting(len(self.connections) - self.max_concurrency + 1)

    def data_received(self, data: bytes) -> None:
        self.data_since = self.loop.time()
        super().data_received(data)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_head_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_task is not None:
            self._head_task.cancel()
        super().connection_lost(exc)

    def _waiting(self) -> bool:
        """No request in progress: the connection waits for (the rest of) a request head."""
        return self.cycle is None or self.cycle.response_complete

    def _arm_head_deadline(self) -> None:
        if self._head_task is not None:
            self._head_task.cancel()
        self.head_since = self.loop.time()
        self._head_task = self.loop.call_later(self.head_timeout_s, self._head_deadline)

    def _head_deadline(self) -> None:
        if self._waiting() and not self.transport.is_closing():
            self.transport.close()

    def _stalled(self) -> bool:
        """Waiting for a request, or for the rest of a body that has not advanced for
        body_idle_s (a body that trickles holds a descriptor like a head that does)."""
        if self._waiting():
            return True
        cycle = self.cycle
        return (cycle is not None and not cycle.response_started and cycle.more_body
                and self.loop.time() - self.data_since > self.body_idle_s)

    def _evict_waiting(self, count: int) -> None:
        """Close up to `count` other connections, those stalled longest first (waiting for
        a request, or trickling a body), so that this one is under the limit when its
        request comes (busy ones stay)."""
        waiting = sorted((c for c in self.connections if c is not self
                          and isinstance(c, _Defences) and c._stalled()
                          and not c.transport.is_closing()), key=lambda c: c.head_since)
        if waiting:
            _evictions.warn("HTTP connections at the limit (%d): closing those waiting "
                            "longest for a request", self.max_concurrency)
        for victim in waiting[:count]:
            victim.transport.close()
            # out of the count now: uvloop reports the loss an iteration or two later, when
            # this connection's request may already be in (and over the limit: a 503)
            self.connections.discard(victim)


BODY_WRITER = "kvpool.body_writer"
"""The ASGI scope extension under which kvpool's httptools servers offer a request's
`BodyWriter`."""


class BodyWriter:
    """Writes bytes of a started, chunked response body at once, outside the ASGI `send`:
    from a transport's callback, where nothing can be awaited. `ready()` says whether it may
    (the body is under way, the client is there, its transport not over its high-water mark);
    where it may not, the caller uses `send`, which waits for the client. The same bytes as
    uvicorn's `send` of a body chunk, on the same transport, so the two can take turns.

    It holds its request cycle weakly: the cycle's scope holds the writer, and a strong
    reference back would leave every request a reference cycle for the garbage collector to
    find (9 objects each, in the proxy and the workers alike). A cycle that is gone
    has finished its response: the writer is then never `ready()`."""

    __slots__ = ("_cycle", "_proto")

    def __init__(self, cycle: Any, proto: Any) -> None:
        self._cycle, self._proto = weakref.ref(cycle), proto

    def ready(self) -> bool:
        c = self._cycle()
        return c is not None and c.response_started and not c.response_complete \
            and not c.disconnected and c.chunked_encoding and not c.flow.write_paused

    def write(self, data: bytes) -> None:
        """One chunk of the body (call `ready()` first)."""
        c = self._cycle()
        assert c is not None, "ready() said the response is under way"
        c.transport.write(b"%x\r\n%b\r\n" % (len(data), data))

    def watch_disconnect(self, callback: Callable[[], None]) -> Callable[[], None]:
        """`callback()` once the client goes before the response is complete (called from
        the loop, in the connection's loss; at once, through the loop, if it went already):
        what a task reading the ASGI disconnect would learn, without the task. Returns what
        stops the watch."""
        cycle, proto = self._cycle(), self._proto
        if cycle is None:  # its response is over: there is nothing to watch
            return _no_watch
        if cycle.disconnected or proto.transport.is_closing():
            # gone already (its connection lost or being closed before this response began,
            # a pipelined request behind it marked in its stead): nothing more is written
            cycle.disconnected = True
            return cast(Callable[[], None], proto.loop.call_soon(callback).cancel)
        proto.lost_watch = (cycle, callback)

        def stop() -> None:
            if proto.lost_watch is not None and proto.lost_watch[0] is cycle:
                proto.lost_watch = None
        return stop


def _no_watch() -> None:
    """What stops a watch that was never set."""


class _SilentConnectionTimeout(_Defences, H11Protocol):
    """The defences over uvicorn's h11 protocol."""


_HttpToolsDefences: type | None = None
if HttpToolsProtocol is not None:
    class _HttpToolsDefences(_Defences, HttpToolsProtocol):  # type: ignore[no-redef,misc]
        """The defences over uvicorn's httptools protocol (the servers on the per-token
        path), and each request's `BodyWriter` in its scope's extensions."""

        lost_watch: tuple[Any, Callable[[], None]] | None = None
        """The request cycle whose client going away is watched, and whom to tell
        (`BodyWriter.watch_disconnect`)."""

        open_cycles: tuple[Any, ...] = ()
        """The connection's request cycles whose responses were not complete when the last
        request came (the one running, those pipelined behind it)."""

        def on_headers_complete(self) -> None:
            super().on_headers_complete()
            cycle = self.cycle
            if cycle is not None and cycle.scope is self.scope:  # not after an upgrade
                extensions = cast(dict[str, Any], self.scope.setdefault("extensions", {}))
                extensions[BODY_WRITER] = BodyWriter(cycle, self)
                self.open_cycles = (*(c for c in self.open_cycles if not c.response_complete),
                                    cycle)

        def connection_lost(self, exc: Exception | None) -> None:
            watch, self.lost_watch = self.lost_watch, None
            super().connection_lost(exc)
            # uvicorn marks only its newest cycle; with a request pipelined behind the one
            # running, that is the queued request's, and the running one would never learn
            # (its `receive` waits on, its response goes on being made and written)
            cycles, self.open_cycles = self.open_cycles, ()
            for cycle in cycles:
                if not cycle.response_complete:
                    cycle.disconnected = True
                    cycle.message_event.set()
            if watch is not None and not watch[0].response_complete:
                watch[1]()


def fast_stack() -> tuple[str, bool]:
    """(uvicorn's loop name, whether httptools parses) for a `fast` server: uvloop and
    httptools where installed, else asyncio and h11."""
    try:
        import uvloop  # noqa: F401
        loop = "uvloop"
    except ImportError:  # pragma: no cover - uvloop not installed
        loop = "asyncio"
    return loop, _HttpToolsDefences is not None


def _protocol(limits: HttpLimits, httptools: bool = False, hold_heads: bool = False) -> type:
    base = _HttpToolsDefences if httptools and _HttpToolsDefences is not None \
        else _SilentConnectionTimeout
    return type("BoundedHttpProtocol", (base,), {
        "head_timeout_s": limits.head_timeout_s, "body_idle_s": limits.body_idle_s,
        "max_concurrency": limits.max_concurrency, "hold_heads": hold_heads})


class QuietServer(uvicorn.Server):
    """A uvicorn server whose event loop reports accept() failures for want of descriptors
    once per LOG_INTERVAL_S (other loop errors as asyncio would). `on_ready` is called once it
    listens (its lifespan started)."""

    on_ready: Callable[[], None] | None = None

    async def startup(self, sockets: list[Any] | None = None) -> None:
        await super().startup(sockets)
        if self.started and self.on_ready is not None:
            self.on_ready()

    async def serve(self, sockets: list[Any] | None = None) -> None:
        accept_log = RateLimitedLog(_log, LOG_INTERVAL_S)

        def handle(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
            if context.get("message") == _ACCEPT_FAILED:
                accept_log.warn("HTTP accept failed (%s); retrying every second",
                                context.get("exception"))
            else:
                loop.default_exception_handler(context)

        asyncio.get_running_loop().set_exception_handler(handle)
        await super().serve(sockets)


def uvicorn_config(app: Any, limits: HttpLimits, fast: bool = False, hold_heads: bool = False,
                   **overrides: Any) -> uvicorn.Config:
    """A uvicorn.Config for `app` (no access log, no lifespan) with `limits` applied; on
    asyncio's loop and h11, or with `fast` on uvloop and httptools where installed;
    `hold_heads`: `_Defences.hold_heads`."""
    loop, httptools = fast_stack() if fast else ("asyncio", False)
    options: dict[str, Any] = dict(
        log_level="warning", access_log=False, lifespan="off", loop=loop,
        http=_protocol(limits, httptools, hold_heads),
        limit_concurrency=limits.max_concurrency, timeout_keep_alive=limits.idle_timeout_s,
        backlog=limits.backlog)
    options.update(overrides)
    return uvicorn.Config(app, **options)


def raise_open_files_limit() -> int:
    """Lift this process's soft limit on open descriptors to the hard one (a server holds one
    per connection; the usual soft default of 1024 is a few hundred clients); the new limit."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        return int(hard)
    return int(soft)


def descriptor_cap(open_files: int) -> int:
    """The most connections a server with `open_files` descriptors may hold: a quarter (at
    least 64) is kept for what else it opens (worker connections, the pool, files), so that
    at the cap it can still accept, and evict, rather than fail accept() in a loop."""
    return max(8, open_files - max(64, open_files // 4))


def limits_for_descriptors(limits: HttpLimits, open_files: int) -> HttpLimits:
    """`limits` with max_concurrency lowered to what `open_files` descriptors allow."""
    cap = descriptor_cap(open_files)
    if limits.max_concurrency <= cap:
        return limits
    _log.warning("at most %d connections (not %d): %d open files allowed (ulimit -n)",
                 cap, limits.max_concurrency, open_files)
    return replace(limits, max_concurrency=cap)


def serve(app: Any, host: str, port: int, limits: HttpLimits,
          on_ready: Callable[[], None] | None = None, fast: bool = False,
          sockets: list[Any] | None = None, hold_heads: bool = False,
          **overrides: Any) -> None:
    """Run `app` on host:port until stopped (SIGINT/SIGTERM), defended by `limits` (its
    connection cap within the descriptors this process may open), with its lifespan: the
    way kvpool's long-running HTTP commands (proxy, worker) serve. `on_ready`: called once it
    listens; `fast`, `hold_heads`: uvicorn_config's; `sockets`: listening sockets to accept on
    instead of binding host:port (the processes of `kvpool proxy --workers N` share one).
    Once it listens, what start-up made is frozen out of the garbage collector's way
    (`freeze_startup_heap`)."""
    limits = limits_for_descriptors(limits, raise_open_files_limit())
    options = {"lifespan": "on", "host": host, "port": port, **overrides}
    server = QuietServer(uvicorn_config(app, limits, fast, hold_heads, **options))

    def ready() -> None:
        freeze_startup_heap()
        if on_ready is not None:
            on_ready()
    server.on_ready = ready
    server.run(sockets)


SERVING_GC_THRESHOLDS = (10_000, 20, 100)
"""The cyclic collector's thresholds in a serving process (`freeze_startup_heap`), against
Python's (700, 10, 10). A young collection walks every tracked object allocated since the
last one and still alive: on the per-token path, the in-flight streams' objects, walked again
and again while they live and then promoted to be walked by the older collections. Measured
(`kvpool bench proxy --streams 4000 --concurrency 32 --loads stream256`, 4,000 streams, the
start-up collection left out): the proxy's collections 460 -> 84 ms in all, the worker's
1,090 -> 310 ms, a young collection about 3 ms. A pause grows with the first threshold
(50,000: 13-19 ms each). docs/serve.md, "The garbage collector"."""


def freeze_startup_heap() -> None:
    """Collect, then move every object alive (the imported libraries, the app, the tokenizer:
    about 100k objects in the proxy) to the collector's permanent generation: a full
    collection then no longer walks them. In the proxy it took about 60 ms every thousand
    requests, 8% of its CPU under load (docs/serve.md, "The proxy's own cost"). Then the
    collector runs less often (`SERVING_GC_THRESHOLDS`)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*SERVING_GC_THRESHOLDS)


class BodyTooLarge(InvalidArgument):
    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"the request body is {size} bytes, over the limit of {limit}")
        self.size, self.limit = size, limit


async def read_body(request: Any, limit: int, deadline_s: float) -> bytes:
    """A Starlette request's body: BodyTooLarge as soon as it is known to exceed `limit`
    bytes (from its Content-Length, or while it arrives; never read whole), TimeoutError if
    it is not all in within `deadline_s` (a body that trickles in holds no worker for long)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(int(declared), limit)
    if _all_in(request):  # most requests: nothing to wait for, so no deadline to arm
        return await _read_parts(request, limit)
    async with asyncio.timeout(deadline_s):
        return await _read_parts(request, limit)


async def _read_parts(request: Any, limit: int) -> bytes:
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise BodyTooLarge(size, limit)
        parts.append(part)
    return b"".join(parts)


def _all_in(request: Any) -> bool:
    """The whole body has arrived already: uvicorn's request cycle (the ASGI `receive`'s
    owner) has read the message's end, so reading it cannot wait."""
    cycle = getattr(getattr(request, "receive", None), "__self__", None)
    return getattr(cycle, "more_body", True) is False


CLIENT_KEEPALIVE_S = 2.0
"""kvpool's HTTP clients drop idle connections after this long, well before the servers close
them (uvicorn: 5 s by default, 30 s for kvpool workers): a request sent on a connection the
server is closing at that moment fails (ReadError) though nothing was wrong."""


def asgi_header(scope: Any, name: bytes) -> str:
    """The value of header `name` (lower case) in an ASGI HTTP scope; "" when absent."""
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return bytes(value).decode("latin-1")
    return ""


def bearer_header(token: str | None) -> dict[str, str]:
    """The Authorization header that carries `token`; none without a token."""
    return {"Authorization": f"Bearer {token}"} if token else {}


def bearer_matches(header: str | None, token: str) -> bool:
    """Whether an Authorization header value is `Bearer <token>` (constant-time compare)."""
    scheme, _, offered = (header or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(offered.strip().encode(),
                                                              token.encode())
