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
from typing import Any

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


class ApiKeyGate:
    """ASGI middleware: the API's paths need one of `keys`; with `salt_per_api_key`, the
    request's tenant goes in scope["state"][TENANT_KEY]."""

    def __init__(self, app: Any, keys: tuple[str, ...], salt_per_api_key: bool) -> None:
        self.app, self.keys, self.salt = app, keys, salt_per_api_key

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not self.keys or not guarded(scope["path"]):
            await self.app(scope, receive, send)
            return
        header = _header(scope, b"authorization")
        key = matching_key(header, self.keys)
        if key is None:
            await _send_error(send, invalid_api_key())
            return
        if self.salt:
            scope.setdefault("state", {})[TENANT_KEY] = tenant_of(key)
        await self.app(scope, receive, send)


def _header(scope: dict[str, Any], name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return bytes(value).decode("latin-1")
    return None


async def _send_error(send: Any, exc: ApiError) -> None:
    import json

    body = json.dumps(exc.body()).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode()),
               (b"www-authenticate", b"Bearer")]
    await send({"type": "http.response.start", "status": exc.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
