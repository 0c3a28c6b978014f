"""In-process metadata storage: a dict behind a lock (the HTTP server's store, and tests)."""

from __future__ import annotations

import threading

from kvpool.metadata.base import MetadataBackend


class MemoryBackend(MetadataBackend):
    """A thread-safe dict of key -> bytes. Never fails except on misuse."""

    writes_block = False
    """Whether a write waits on I/O (a subclass's journal): the HTTP server then runs it off
    its event loop."""

    def __init__(self) -> None:
        super().__init__("memory://")
        self._write_lock = threading.Lock()
        """Writers, one at a time, across their journal's I/O (a durable subclass's fsync,
        an etcd mirror's round trip)."""
        self._lock = threading.Lock()
        """The dict itself: readers wait for a swap, never for a writer's I/O."""
        self._items: dict[str, bytes] = {}
        self._total_bytes = 0

    @property
    def total_bytes(self) -> int:
        """Bytes of all values stored."""
        return self._total_bytes

    def put_within(self, key: str, value: bytes, max_total_bytes: int) -> bool:
        """Store `value` under `key` unless the values would then total more than
        `max_total_bytes` (False, nothing changed)."""
        key, value = self._usable(key), bytes(value)
        with self._write_lock:
            old = self._items.get(key)
            total = self._total_bytes - (len(old) if old is not None else 0) + len(value)
            if total > max_total_bytes:
                return False
            self._journal_put(key, value)
            with self._lock:
                self._items[key], self._total_bytes = value, total
            return True

    def _get(self, key: str) -> bytes | None:
        with self._lock:
            return self._items.get(key)

    def _put(self, key: str, value: bytes) -> None:
        with self._write_lock:
            old = self._items.get(key)
            self._journal_put(key, value)
            with self._lock:
                self._total_bytes += len(value) - (len(old) if old is not None else 0)
                self._items[key] = value

    def _delete(self, key: str) -> bool:
        with self._write_lock:
            if key not in self._items:
                return False
            self._journal_delete(key)
            with self._lock:
                self._total_bytes -= len(self._items.pop(key))
            return True

    def _journal_put(self, key: str, value: bytes) -> None:
        """Called under the write lock (not the readers') before a put changes anything (a
        durable subclass logs it here; raising leaves the store unchanged)."""

    def _journal_delete(self, key: str) -> None:
        """Called under the write lock before a delete of a present key changes anything."""

    def keys(self, prefix: str = "") -> list[str]:
        """Sorted keys that start with `prefix` (a snapshot)."""
        with self._lock:
            return sorted(k for k in self._items if k.startswith(prefix))

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)
