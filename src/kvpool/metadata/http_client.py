"""Client of the HTTP metadata protocol: `GET|PUT|DELETE <url>?key=K` (Mooncake-compatible)."""

from __future__ import annotations

import httpx

from kvpool.errors import MetadataError, MetadataUnavailable
from kvpool.metadata.base import MetadataBackend, MetadataClientConfig
from kvpool.metadata.http_serving import bearer_header


class HttpMetadataBackend(MetadataBackend):
    """Talks to a `kvpool metadata` server (or Mooncake's) through a pooled httpx client.

    200 answers carry the value (GET) or confirm the change; 404 means absent (GET -> None,
    DELETE -> False). Any other status, a refused connection or a timeout is a MetadataError.
    """

    def __init__(self, url: str, config: MetadataClientConfig | None = None) -> None:
        super().__init__(url)
        self.config = config or MetadataClientConfig()
        limits = httpx.Limits(
            max_connections=self.config.max_connections,
            max_keepalive_connections=self.config.max_connections,
        )
        self._client = httpx.Client(
            timeout=httpx.Timeout(self.config.timeout_s), limits=limits, trust_env=False,
            headers=bearer_header(self.config.token),
        )

    def _get(self, key: str) -> bytes | None:
        response = self._request("GET", key)
        if response.status_code == 404:
            return None
        self._expect_ok(response, "GET", key)
        return response.content

    def _put(self, key: str, value: bytes) -> None:
        response = self._request("PUT", key, value)
        self._expect_ok(response, "PUT", key)

    def _delete(self, key: str) -> bool:
        response = self._request("DELETE", key)
        if response.status_code == 404:
            return False
        self._expect_ok(response, "DELETE", key)
        return True

    def _release(self) -> None:
        self._client.close()

    def _request(self, method: str, key: str, body: bytes | None = None) -> httpx.Response:
        try:
            return self._client.request(method, self.url, params={"key": key}, content=body)
        except httpx.TimeoutException as exc:
            raise MetadataUnavailable(
                f"metadata server {self.url} did not answer {method} {key!r} within "
                f"{self.config.timeout_s}s: {type(exc).__name__}: {exc}"
            ) from exc
        except (httpx.TransportError, httpx.InvalidURL) as exc:
            raise MetadataUnavailable(
                f"metadata server {self.url} unreachable for {method} {key!r}: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        except RuntimeError as exc:  # httpx raises this once the client is closed
            raise MetadataError(f"metadata backend {self.url}: {exc}") from exc

    def _expect_ok(self, response: httpx.Response, method: str, key: str) -> None:
        if response.status_code != 200:
            detail = response.text[:200].strip()
            raise MetadataError(
                f"metadata server {self.url} answered {response.status_code} to "
                f"{method} {key!r}: {detail or response.reason_phrase}"
            )
