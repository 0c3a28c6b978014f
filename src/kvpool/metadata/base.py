"""The contract every metadata backend keeps, and the client-side configuration.

A backend is a flat key/value directory: `str` keys (stored verbatim, UTF-8 on the wire) map to
opaque `bytes` values. The caller chooses the key layout; backends never rewrite keys.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from types import TracebackType

from kvpool.errors import ConfigError, InvalidArgument, MetadataError
from kvpool.token import env_token

DEFAULT_TIMEOUT_S = 5.0
DEFAULT_MAX_KEY_LEN = 1024
DEFAULT_MAX_VALUE_BYTES = 16 << 20
DEFAULT_MAX_TOTAL_BYTES = 64 << 20


@dataclass(frozen=True)
class MetadataClientConfig:
    """How a client backend talks to a remote metadata service."""

    timeout_s: float = DEFAULT_TIMEOUT_S
    """Limit on each attempt to connect, send or receive; no call waits longer than this
    (times the number of etcd endpoints tried)."""
    max_connections: int = 16
    """Size of the HTTP connection pool shared by all threads using one backend."""
    token: str | None = field(default_factory=env_token,
                              repr=False)
    """Shared secret sent with writes to an HTTP metadata server (default: $KVPOOL_TOKEN)."""

    def __post_init__(self) -> None:
        if not 0 < self.timeout_s <= 3600:
            raise ConfigError(f"timeout_s must be in (0, 3600] seconds, got {self.timeout_s}")
        if not 1 <= self.max_connections <= 1024:
            raise ConfigError(f"max_connections must be in [1, 1024], got {self.max_connections}")


def check_key(key: object) -> str:
    """Return `key` if it is a usable key, else raise InvalidArgument."""
    if not isinstance(key, str):
        raise InvalidArgument(f"metadata key must be a str, got {type(key).__name__}")
    if not key.strip():
        raise InvalidArgument(f"metadata key must not be empty or blank, got {key!r}")
    return key


def check_value(value: object) -> bytes:
    """Return `value` as bytes if it is bytes-like, else raise InvalidArgument."""
    if isinstance(value, bytes):
        return value
    if isinstance(value, bytearray | memoryview):
        return bytes(value)
    raise InvalidArgument(
        f"metadata value must be bytes (encode text yourself), got {type(value).__name__}"
    )


class MetadataBackend(ABC):
    """A thread-safe key/value directory.

    Public methods check their arguments (InvalidArgument on misuse) and then call the
    `_get/_put/_delete` hooks. Remote backends raise MetadataError, carrying the service URL
    and the cause, when the service is unreachable, times out, or answers garbage; they never
    block longer than their configured timeout.
    """

    def __init__(self, url: str) -> None:
        self.url = url
        self._closed = threading.Event()
        self._close_lock = threading.Lock()

    def get(self, key: str) -> bytes | None:
        """The value stored under `key`, or None when there is none."""
        return self._get(self._usable(key))

    def put(self, key: str, value: bytes | bytearray | memoryview) -> None:
        """Store a copy of `value` under `key`, replacing any previous value."""
        data = check_value(value)
        self._put(self._usable(key), data)

    def delete(self, key: str) -> bool:
        """Remove `key`; True when it existed, False when it was already absent."""
        return self._delete(self._usable(key))

    def close(self) -> None:
        """Release connections. Idempotent; later calls raise MetadataError."""
        with self._close_lock:
            if self._closed.is_set():
                return
            self._closed.set()
        self._release()

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def __enter__(self) -> MetadataBackend:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    def _usable(self, key: str) -> str:
        if self._closed.is_set():
            raise MetadataError(f"metadata backend {self.url} is closed")
        return check_key(key)

    @abstractmethod
    def _get(self, key: str) -> bytes | None: ...

    @abstractmethod
    def _put(self, key: str, value: bytes) -> None: ...

    @abstractmethod
    def _delete(self, key: str) -> bool: ...

    def _release(self) -> None:
        """Free resources held by the backend (called once, by close)."""
        return None
