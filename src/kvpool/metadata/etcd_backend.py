"""etcd backend: keys and values stored verbatim in etcd's v3 key space.

It speaks to etcd's grpc-gateway (JSON over HTTP) through the `etcd3gw` library. etcd 3.4 and
later serve the gateway under `/v3/` (3.3 used `/v3beta/`), so the prefix is set explicitly
rather than discovered, which saves a round trip and does not depend on the etcd3gw version.
With several endpoints, a call that cannot reach one moves on to the next and remembers the
one that answered.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

import requests
from etcd3gw import exceptions as etcd_exc
from etcd3gw.client import Etcd3Client

from kvpool.errors import MetadataError, MetadataUnavailable
from kvpool.metadata.base import MetadataBackend, MetadataClientConfig

ETCD_API_PATH = "/v3/"
_UNREACHABLE = (etcd_exc.ConnectionFailedError, etcd_exc.ConnectionTimeoutError,
                requests.exceptions.ChunkedEncodingError, requests.exceptions.ConnectionError,
                requests.exceptions.Timeout)
"""An endpoint that cannot be reached, or broke off its reply (a truncated body raises
requests' own errors, not etcd3gw's): the next endpoint is tried."""
_GARBAGE = (etcd_exc.Etcd3Exception, ValueError, KeyError, TypeError)

T = TypeVar("T")


class EtcdMetadataBackend(MetadataBackend):
    """Metadata in a real etcd cluster. Keys go to etcd as their UTF-8 bytes."""

    def __init__(
        self,
        endpoints: Sequence[tuple[str, int]],
        config: MetadataClientConfig | None = None,
        api_path: str = ETCD_API_PATH,
    ) -> None:
        if not endpoints:
            raise MetadataError("etcd backend needs at least one host:port endpoint")
        super().__init__("etcd://" + ",".join(f"{h}:{p}" for h, p in endpoints))
        self.config = config or MetadataClientConfig()
        self._clients = [self._make_client(h, p, api_path) for h, p in endpoints]
        self._lock = threading.Lock()
        self._preferred = 0

    def _make_client(self, host: str, port: int, api_path: str) -> Etcd3Client:
        session = requests.Session()
        session.trust_env = False  # never route loopback traffic through an env proxy
        return Etcd3Client(
            host=host, port=port, timeout=self.config.timeout_s, api_path=api_path,
            session=session,
        )

    def _get(self, key: str) -> bytes | None:
        values = self._call("get", key, lambda c: c.get(key.encode()))
        if not values:
            return None
        if len(values) != 1 or not isinstance(values[0], bytes):
            raise MetadataError(f"etcd {self.url} answered {len(values)} values for {key!r}")
        return values[0]

    def _put(self, key: str, value: bytes) -> None:
        self._call("put", key, lambda c: c.put(key.encode(), value))

    def _delete(self, key: str) -> bool:
        return bool(self._call("delete", key, lambda c: c.delete(key.encode())))

    def items_with_prefix(self, prefix: str) -> dict[str, bytes]:
        """Every key that starts with `prefix` (returned without it) and its value; one
        range read, so a consistent snapshot."""
        found = self._call("scan", prefix, lambda c: c.get_prefix(prefix.encode()))
        return {bytes(meta["key"]).decode()[len(prefix):]: bytes(value)
                for value, meta in found}

    def _release(self) -> None:
        for client in self._clients:
            client.session.close()

    def _call(self, op: str, key: str, fn: Callable[[Etcd3Client], T]) -> T:
        """Run `fn` on the preferred endpoint, failing over to the others when unreachable."""
        with self._lock:
            start = self._preferred
        failures: list[str] = []
        for step in range(len(self._clients)):
            index = (start + step) % len(self._clients)
            client = self._clients[index]
            try:
                result = fn(client)
            except _UNREACHABLE as exc:
                failures.append(f"{client.host}:{client.port}: {_describe(exc)}")
                continue
            except _GARBAGE as exc:
                raise MetadataError(
                    f"etcd {client.host}:{client.port} failed {op} {key!r}: {_describe(exc)}"
                ) from exc
            with self._lock:
                self._preferred = index
            return result
        raise MetadataUnavailable(
            f"etcd {self.url} unreachable for {op} {key!r} "
            f"(timeout {self.config.timeout_s}s): " + "; ".join(failures)
        )


def _describe(exc: BaseException) -> str:
    detail = getattr(exc, "detail_text", None) or str(exc)
    return f"{type(exc).__name__}: {str(detail)[:300]}"
