"""Who may call the proxy.

- The OpenAI API (every /v1/ path, /tokenize, /detokenize) takes optional API keys, as
  vLLM's `--api-key` does: `Authorization: Bearer KEY` with any one of them, else a 401 in
  OpenAI's error shape. /health and /version stay open (probes).
- The admin endpoints (/metrics, /stats/samples, /workers/register) take the cluster token
  instead (`Proxy.authorized`), the one the workers hold.

With `salt_per_api_key`, each key is a tenant: its requests cache under a salt derived from
the key (`tenant_of`), so one tenant's prompts can neither hit nor probe another's prefixes.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import time
from collections.abc import Callable
from typing import Any

from kvpool.metadata.http_serving import asgi_header
from kvpool.serve.errors import ApiError

API_PATHS = ("/tokenize", "/detokenize")
"""Outside /v1/, the paths the API keys guard."""
TENANT_KEY = "kvpool_tenant"
"""Where the gate leaves the request's tenant (scope["state"]), for the salt."""


def guarded(path: str) -> bool:
    return path.startswith("/v1/") or path in API_PATHS


def matching_key(header: str | None, keys: tuple[str, ...]) -> str | None:
    """The key `header` (`Bearer KEY`) presents, if it is one of `keys` (each compared in
    constant time, all of them always)."""
    scheme, _, offered = (header or "").partition(" ")
    if scheme.lower() != "bearer":
        return None
    given = offered.strip().encode()
    found = None
    for key in keys:
        if hmac.compare_digest(given, key.encode()):
            found = key
    return found


def tenant_of(key: str) -> str:
    """A tenant's name in cache salts: a digest of its key (the key itself never travels)."""
    return "t-" + hashlib.blake2b(key.encode(), digest_size=8,
                                  person=b"kvpool-tenant").hexdigest()


def invalid_api_key() -> ApiError:
    return ApiError(401, "Incorrect or missing API key: send Authorization: Bearer KEY",
                    type="invalid_request_error", code="invalid_api_key")


class FailedKeyLimiter:
    """Wrong API keys per client address, as a token bucket on an injected clock: each
    address may fail `burst` times at once and `per_s` times a second after that; beyond
    it the gate answers 429 without comparing the key (guessing runs at `per_s`, not at
    the proxy's request rate). The only writer of its table, which it bounds by pruning
    addresses whose buckets are full again."""

    def __init__(self, per_s: float = 5.0, burst: float = 64.0, max_clients: int = 1 << 16) -> None:
        self.per_s, self.burst, self.max_clients = per_s, burst, max_clients
        self._spent: dict[str, tuple[float, float]] = {}
        """address -> (failures not yet refilled, when that was counted)"""

    def _level(self, client: str, now: float) -> float:
        spent, at = self._spent.get(client, (0.0, now))
        return max(0.0, spent - (now - at) * self.per_s)

    def retry_after_s(self, client: str, now: float) -> float:
        """0 if `client` may try a key now, else how long until it may."""
        over = self._level(client, now) + 1 - self.burst
        return over / self.per_s if over > 0 else 0.0

    def failed(self, client: str, now: float) -> None:
        if len(self._spent) >= self.max_clients:
            self._spent = {c: v for c, v in self._spent.items() if self._level(c, now) > 0}
        self._spent[client] = (self._level(client, now) + 1, now)


def too_many_failures(retry_after_s: float) -> ApiError:
    return ApiError(429, "too many wrong API keys from this address: wait "
                    f"{retry_after_s:.1f} s", type="rate_limit_error", code="too_many_failures",
                    headers={"Retry-After": str(max(1, math.ceil(retry_after_s)))})


class ApiKeyGate:
    """ASGI middleware: the API's paths need one of `keys`; with `salt_per_api_key`, the
    request's tenant goes in scope["state"][TENANT_KEY]. Wrong keys are rate-limited per
    client address (`FailedKeyLimiter`)."""

    def __init__(self, app: Any, keys: tuple[str, ...], salt_per_api_key: bool,
                 now: Callable[[], float] = time.monotonic) -> None:
        self.app, self.keys, self.salt, self.now = app, keys, salt_per_api_key, now
        self.limiter = FailedKeyLimiter()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not self.keys or not guarded(scope["path"]):
            await self.app(scope, receive, send)
            return
        client, now = (scope.get("client") or ("?", 0))[0], self.now()
        wait_s = self.limiter.retry_after_s(client, now)
        if wait_s > 0:
            await _send_error(send, too_many_failures(wait_s))
            return
        key = matching_key(asgi_header(scope, b"authorization"), self.keys)
        if key is None:
            self.limiter.failed(client, now)
            await _send_error(send, invalid_api_key())
            return
        if self.salt:
            scope.setdefault("state", {})[TENANT_KEY] = tenant_of(key)
        await self.app(scope, receive, send)


async def _send_error(send: Any, exc: ApiError) -> None:
    import json

    body = json.dumps(exc.body()).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode()),
               (b"www-authenticate", b"Bearer"),
               *((k.lower().encode(), v.encode()) for k, v in exc.headers.items())]
    await send({"type": "http.response.start", "status": exc.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
