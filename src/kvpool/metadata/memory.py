"""In-process metadata storage: a dict behind a lock (the HTTP server's store, and tests)."""

from __future__ import annotations

import threading

from kvpool.metadata.base import MetadataBackend


class MemoryBackend(MetadataBackend):
    """A thread-safe dict of key -> bytes. Never fails except on misuse."""

    def __init__(self) -> None:
        super().__init__("memory://")
        self._lock = threading.Lock()
        self._items: dict[str, bytes] = {}

    def _get(self, key: str) -> bytes | None:
        with self._lock:
            return self._items.get(key)

    def _put(self, key: str, value: bytes) -> None:
        with self._lock:
            self._items[key] = value

    def _delete(self, key: str) -> bool:
        with self._lock:
            return self._items.pop(key, None) is not None

    def keys(self, prefix: str = "") -> list[str]:
        """Sorted keys that start with `prefix` (a snapshot)."""
        with self._lock:
            return sorted(k for k in self._items if k.startswith(prefix))

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)
