"""HTTP calls from the proxy to one worker (docs/worker-api.md), over one shared
`httpx.AsyncClient`. Every failure is raised as `WorkerCallError` naming the worker and the call;
an abort is best-effort and never raises."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from typing import Any

import httpx

from kvpool.errors import KvpoolError
from kvpool.log import get_logger
from kvpool.metadata.http_serving import CLIENT_KEEPALIVE_S, bearer_header

log = get_logger("serve.worker_client")


class WorkerCallError(KvpoolError):
    """A worker call failed: unreachable, an error status, a malformed reply, or an
    `{"error": ...}` line in a stream. `status` is the worker's HTTP status, if it answered."""

    def __init__(self, url: str, call: str, message: str, status: int | None = None) -> None:
        super().__init__(f"worker {url} {call}: {message}")
        self.status = status


def _error_text(resp: httpx.Response, body: bytes) -> str:
    try:
        err = json.loads(body).get("error")
        return str(err.get("message") if isinstance(err, dict) else err)
    except (ValueError, AttributeError):
        return f"HTTP {resp.status_code}: {body[:200]!r}"


class WorkerClient:
    def __init__(self, timeout_s: float, token: str | None = None) -> None:
        self.http = httpx.AsyncClient(
            headers=bearer_header(token), timeout=httpx.Timeout(timeout_s, connect=5.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64,
                                keepalive_expiry=CLIENT_KEEPALIVE_S))

    async def aclose(self) -> None:
        await self.http.aclose()

    async def get_json(self, url: str, path: str, timeout_s: float) -> dict[str, Any]:
        try:
            resp = await self.http.get(url + path, timeout=timeout_s)
        except httpx.HTTPError as exc:
            raise WorkerCallError(url, path, repr(exc)) from None
        if resp.status_code != 200:
            raise WorkerCallError(url, path, _error_text(resp, resp.content), resp.status_code)
        return _json_object(url, path, resp.content)

    async def prefill(self, url: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            resp = await self.http.post(url + "/prefill", json=body)
        except httpx.HTTPError as exc:
            raise WorkerCallError(url, "/prefill", repr(exc)) from None
        if resp.status_code != 200:
            raise WorkerCallError(url, "/prefill", _error_text(resp, resp.content),
                                  resp.status_code)
        return _json_object(url, "/prefill", resp.content)

    async def generate(self, url: str, body: dict[str, Any]) -> AsyncGenerator[dict[str, Any]]:
        """The NDJSON lines of /generate; an `{"error"}` line or a broken stream raises."""
        try:
            async with self.http.stream("POST", url + "/generate", json=body) as resp:
                if resp.status_code != 200:
                    raise WorkerCallError(url, "/generate",
                                          _error_text(resp, await resp.aread()), resp.status_code)
                async for line in resp.aiter_lines():
                    if not line.strip():
                        continue
                    obj = _json_object(url, "/generate", line.encode())
                    if "error" in obj:
                        raise WorkerCallError(url, "/generate", str(obj["error"]))
                    yield obj
        except httpx.HTTPError as exc:
            raise WorkerCallError(url, "/generate", repr(exc)) from None

    async def abort(self, url: str, request_id: str) -> None:
        try:
            await self.http.post(url + "/abort", json={"request_id": request_id}, timeout=2.0)
        except httpx.HTTPError as exc:
            log.debug("abort of %s on %s failed: %r", request_id, url, exc)


def _json_object(url: str, call: str, raw: bytes) -> dict[str, Any]:
    try:
        obj = json.loads(raw)
    except ValueError:
        raise WorkerCallError(url, call, f"reply is not JSON: {raw[:200]!r}") from None
    if not isinstance(obj, dict):
        raise WorkerCallError(url, call, f"reply is not a JSON object: {raw[:200]!r}")
    return obj
