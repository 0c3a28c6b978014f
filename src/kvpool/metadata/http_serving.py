"""How kvpool runs its HTTP servers (metadata, master admin) with uvicorn: bounded
concurrency and idle time, shared by every server so that they defend alike.

- `max_concurrency`: connections plus requests in progress; above it uvicorn answers 503.
- `idle_timeout_s`: a keep-alive connection with no new request, and (unlike plain uvicorn)
  a fresh connection that has not sent a byte yet, is closed after this long, so a flood of
  silent connections gives its descriptors back.
- When accept() runs out of descriptors, asyncio rests the listener for a second, but logs
  a traceback for every attempt (a backlog's worth each second); `QuietServer` logs one
  line per interval instead.

Repeated warnings go through `kvpool.log.RateLimitedLog`.
"""

from __future__ import annotations

import asyncio
import hmac
from dataclasses import dataclass
from typing import Any

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvpool.errors import ConfigError
from kvpool.log import RateLimitedLog, get_logger

LOG_INTERVAL_S = 5.0
_ACCEPT_FAILED = "socket.accept() out of system resource"
_log = get_logger("http")


@dataclass(frozen=True)
class HttpLimits:
    max_concurrency: int = 256
    """Connections and requests in progress at once; more get 503 Service Unavailable."""
    idle_timeout_s: float = 5.0
    """Close a connection idle this long (before its first request or between requests)."""
    backlog: int = 128
    """Connections the kernel queues before they are accepted."""

    def __post_init__(self) -> None:
        if not 1 <= self.max_concurrency <= 1 << 16:
            raise ConfigError(f"max_concurrency must be in [1, 65536], got "
                              f"{self.max_concurrency}")
        if not 0 < self.idle_timeout_s <= 3600:
            raise ConfigError(f"idle_timeout_s must be in (0, 3600], got {self.idle_timeout_s}")
        if not 1 <= self.backlog <= 65535:
            raise ConfigError(f"backlog must be in [1, 65535], got {self.backlog}")


class _SilentConnectionTimeout(H11Protocol):
    """uvicorn's h11 protocol, with its keep-alive timer also running from the moment a
    connection is accepted (uvicorn starts it only after a first response)."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.timeout_keep_alive_task = self.loop.call_later(
            self.timeout_keep_alive, self.timeout_keep_alive_handler)


class QuietServer(uvicorn.Server):
    """A uvicorn server whose event loop reports accept() failures for want of descriptors
    once per LOG_INTERVAL_S (other loop errors as asyncio would)."""

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


def uvicorn_config(app: Any, limits: HttpLimits, **overrides: Any) -> uvicorn.Config:
    """A uvicorn.Config for `app` (no access log, no lifespan) with `limits` applied."""
    options: dict[str, Any] = dict(
        log_level="warning", access_log=False, lifespan="off", http=_SilentConnectionTimeout,
        limit_concurrency=limits.max_concurrency, timeout_keep_alive=limits.idle_timeout_s,
        backlog=limits.backlog)
    options.update(overrides)
    return uvicorn.Config(app, **options)


def bearer_matches(header: str | None, token: str) -> bool:
    """Whether an Authorization header value is `Bearer <token>` (constant-time compare)."""
    scheme, _, offered = (header or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(offered.strip().encode(),
                                                              token.encode())
