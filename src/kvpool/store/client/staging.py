"""The client's staging memory for the bytes API: one managed buffer carved by an allocator,
with a fallback to a temporarily registered array when it is full or too small."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from kvpool.store.allocator import OffsetAllocator


class StagingArea:
    def __init__(self, engine: Any, size: int) -> None:
        self._engine = engine
        self._lock = threading.Lock()
        self._buf = engine.allocate_managed(size) if size > 0 else None
        self._alloc = OffsetAllocator(size, alignment=64)

    def acquire(self, num_bytes: int) -> tuple[int, memoryview, Any]:
        """(address, writable view, release token) of `num_bytes` registered bytes."""
        if self._buf is not None and num_bytes > 0:
            with self._lock:
                offset = self._alloc.allocate(num_bytes)
            if offset is not None:
                view = self._buf.view[offset:offset + num_bytes]
                return self._buf.addr + offset, view, offset
        arr = np.empty(max(num_bytes, 1), dtype=np.uint8)
        reg = self._engine.register(arr)
        return reg.addr, arr.data[:num_bytes], reg

    def release(self, token: Any) -> None:
        if isinstance(token, int):
            with self._lock:
                self._alloc.free(token)
        else:
            self._engine.unregister(token.addr)

    def close(self) -> None:
        if self._buf is not None:
            self._engine.free_managed(self._buf)
            self._buf = None
