"""Data paths of the compat store: bytes (`put`/`get`/`upsert`...) and zero-copy
(`register_buffer`, `put_from`, `get_into`, batches and multi-buffer scatter/gather).

Mooncake's conventions: `put` of an existing key returns 0 and leaves the object as it was;
`get` of a missing key is `b""`; `get_buffer` of one is None; `*_get_into*` return the bytes
read or a negative code (a buffer smaller than the object gives -600); a list-length mismatch
gives -600 for every item. Unlike Mooncake, zero-copy calls check that every address lies in
registered memory (-600 otherwise) instead of reading whatever the pointer points to.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvpool.compat.mooncake.store_base import (
    INVALID,
    StoreBase,
    code,
    log,
    needs_setup,
    per_key,
    scatter,
    share_results,
    upsert_once,
)
from kvpool.compat.mooncake.types import BufferHandle, ReplicateConfig
from kvpool.errors import KvpoolError
from kvpool.store.wire.codes import ErrorCode

Parts = list[tuple[int, int]]


def _bytes_of(value: Any) -> memoryview | None:
    """`value`'s bytes (a view; a copy for a buffer that is not contiguous, which Mooncake
    stores too), None for no buffer or an empty one."""
    try:
        view = memoryview(value)
    except TypeError:
        return None
    try:
        view = view.cast("B")
    except TypeError:  # not C-contiguous
        view = memoryview(view.tobytes())
    return view if view.nbytes else None


class StoreData(StoreBase):
    # -- bytes -----------------------------------------------------------------------------

    @needs_setup(code)
    def put(self, key: str, value: Any, config: ReplicateConfig | None = None) -> int:
        return self._put_values([key], [value], config, upsert=False)[0]

    @needs_setup(code)
    def upsert(self, key: str, value: Any, config: ReplicateConfig | None = None) -> int:
        return self._put_values([key], [value], config, upsert=True)[0]

    @needs_setup(code)
    def put_batch(self, keys: Sequence[str], values: Sequence[Any],
                  config: ReplicateConfig | None = None) -> int:
        """0 when every value is stored, else the first failure code; nothing is stored
        when a value is no bytes (or empty), as in Mooncake."""
        if len(keys) != len(values):
            return INVALID
        return next((c for c in self._put_values(keys, values, config, False, whole=True)
                     if c), 0)

    @needs_setup(code)
    def upsert_batch(self, keys: Sequence[str], values: Sequence[Any],
                     config: ReplicateConfig | None = None) -> int:
        if len(keys) != len(values):
            return INVALID
        return next((c for c in self._put_values(keys, values, config, True, whole=True)
                     if c), 0)

    @needs_setup(code)
    def put_parts(self, key: str, *args: Any, config: ReplicateConfig | None = None) -> int:
        """One object from several bytes-like parts, concatenated in order."""
        return self._put_values([key], [_join(args)], config, upsert=False)[0]

    @needs_setup(code)
    def upsert_parts(self, key: str, *args: Any, config: ReplicateConfig | None = None) -> int:
        return self._put_values([key], [_join(args)], config, upsert=True)[0]

    def _put_values(self, keys: Sequence[str], values: Sequence[Any],
                    config: ReplicateConfig | None, upsert: bool,
                    whole: bool = False) -> list[int]:
        """Each value's put code; with `whole`, none is stored when one is no bytes."""
        views = [_bytes_of(v) for v in values]
        if whole and any(v is None for v in views):
            return [INVALID] * len(keys)
        ok, shared = upsert_once(keys, [i for i, v in enumerate(views) if v is not None],
                                 upsert, last=False)
        sub_keys = [keys[i] for i in ok]
        sub_views = [views[i] for i in ok]
        results = self._put(len(ok), config, lambda idx, cfg: self.client.put_batch(
            [sub_keys[i] for i in idx], [sub_views[i] for i in idx], cfg, upsert))
        return share_results(scatter(len(keys), ok, results), shared)

    def get(self, key: str, /) -> bytes:
        if self._client is None:
            return b""
        result = self._client.get(key)
        return result.data if result.ok else b""

    def get_batch(self, keys: Sequence[str], /) -> list[bytes]:
        if self._client is None:
            return [b""] * len(keys)
        return [r.data if r.ok else b"" for r in self._client.get_batch(list(keys))]

    def get_buffer(self, key: str, /) -> BufferHandle | None:
        """The object's bytes in a buffer the caller owns, or None when it is missing."""
        return self.batch_get_buffer([key])[0]

    def batch_get_buffer(self, keys: Sequence[str], /) -> list[BufferHandle | None]:
        if self._client is None:
            return [None] * len(keys)
        return [BufferHandle(r.data) if r.ok else None
                for r in self._client.get_batch(list(keys))]

    # -- zero-copy -------------------------------------------------------------------------

    @needs_setup(code)
    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        """0, or -600 for a bad range or one overlapping registered memory."""
        registry = self.client.engine.registry
        if type(buffer_ptr) is not int or type(size) is not int or buffer_ptr <= 0 or size <= 0:
            return INVALID
        if any(b.addr < buffer_ptr + size and buffer_ptr < b.addr + b.length
               for b in registry.buffers()):
            return INVALID
        try:
            self.client.register_buffer(buffer_ptr, size)
        except KvpoolError as exc:
            log.warning("register_buffer(%#x, %d): %s", buffer_ptr, size, exc)
            return INVALID
        return 0

    @needs_setup(code)
    def unregister_buffer(self, buffer_ptr: int) -> int:
        try:
            self.client.unregister_buffer(buffer_ptr)
        except KvpoolError:
            return INVALID
        return 0

    @needs_setup(code)
    def put_from(self, key: str, buffer_ptr: int, size: int,
                 config: ReplicateConfig | None = None) -> int:
        return self._put_parts([key], [[(buffer_ptr, size)]], config, False)[0]

    @needs_setup(code)
    def upsert_from(self, key: str, buffer_ptr: int, size: int,
                    config: ReplicateConfig | None = None) -> int:
        return self._put_parts([key], [[(buffer_ptr, size)]], config, True)[0]

    @needs_setup(per_key)
    def batch_put_from(self, keys: Sequence[str], buffer_ptrs: Sequence[int],
                       sizes: Sequence[int], config: ReplicateConfig | None = None) -> list[int]:
        if not len(keys) == len(buffer_ptrs) == len(sizes):
            return [INVALID] * len(keys)
        return self._put_parts(keys, [[(p, s)] for p, s in zip(buffer_ptrs, sizes, strict=True)],
                               config, False)

    @needs_setup(per_key)
    def batch_upsert_from(self, keys: Sequence[str], buffer_ptrs: Sequence[int],
                          sizes: Sequence[int], config: ReplicateConfig | None = None) -> list[int]:
        if not len(keys) == len(buffer_ptrs) == len(sizes):
            return [INVALID] * len(keys)
        return self._put_parts(keys, [[(p, s)] for p, s in zip(buffer_ptrs, sizes, strict=True)],
                               config, True)

    @needs_setup(per_key)
    def batch_put_from_multi_buffers(self, keys: Sequence[str],
                                     all_buffer_ptrs: Sequence[Sequence[int]],
                                     all_sizes: Sequence[Sequence[int]],
                                     config: ReplicateConfig | None = None) -> list[int]:
        """Object i is the concatenation of its pieces (e.g. one block's K and V pages of
        every layer), written without a copy into the pool."""
        parts = _zip_parts(keys, all_buffer_ptrs, all_sizes)
        if parts is None:
            return [INVALID] * len(keys)
        return self._put_parts(keys, parts, config, False)

    def _put_parts(self, keys: Sequence[str], parts: Sequence[Parts | None],
                   config: ReplicateConfig | None, upsert: bool) -> list[int]:
        ok, shared = upsert_once(keys, [i for i, p in enumerate(parts)
                                        if p is not None and self._registered(p)], upsert,
                                 last=True)
        sub_keys = [keys[i] for i in ok]
        sub_parts = [parts[i] or [] for i in ok]
        results = self._put(len(ok), config, lambda idx, cfg: self.client.batch_put_from_parts(
            [sub_keys[i] for i in idx], [sub_parts[i] for i in idx], cfg, upsert))
        return share_results(scatter(len(keys), ok, results), shared)

    @needs_setup(code)
    def get_into(self, key: str, buffer_ptr: int, size: int) -> int:
        """Bytes read into the buffer, or a negative code (-600 when it is too small)."""
        return self._get_parts([key], [[(buffer_ptr, size)]])[0]

    @needs_setup(per_key)
    def batch_get_into(self, keys: Sequence[str], buffer_ptrs: Sequence[int],
                       sizes: Sequence[int]) -> list[int]:
        if not len(keys) == len(buffer_ptrs) == len(sizes):
            return [INVALID] * len(keys)
        return self._get_parts(keys, [[(p, s)] for p, s in zip(buffer_ptrs, sizes, strict=True)])

    @needs_setup(per_key)
    def batch_get_into_multi_buffers(self, keys: Sequence[str],
                                     all_buffer_ptrs: Sequence[Sequence[int]],
                                     all_sizes: Sequence[Sequence[int]],
                                     prefer_alloc_in_same_node: bool = False) -> list[int]:
        """Object i is spread over its pieces in order; returns bytes read per object."""
        parts = _zip_parts(keys, all_buffer_ptrs, all_sizes)
        if parts is None:
            return [INVALID] * len(keys)
        return self._get_parts(keys, parts)

    def _get_parts(self, keys: Sequence[str], parts: Sequence[Parts | None]) -> list[int]:
        ok = [i for i, p in enumerate(parts) if p is not None and self._registered(p)]
        results = self.client.batch_get_into_parts([keys[i] for i in ok],
                                                   [parts[i] or [] for i in ok])
        return scatter(len(keys), ok, [r.value for r in results])


def _join(parts: Sequence[Any]) -> bytes:
    return b"".join(bytes(memoryview(p).cast("B")) for p in parts)


def _zip_parts(keys: Sequence[str], ptrs: Sequence[Sequence[int]],
               sizes: Sequence[Sequence[int]]) -> list[Parts | None] | None:
    """Per-key piece lists, without their empty pieces (an empty layer: Mooncake skips
    them too); None when the outer lists differ in length, a None entry for a key whose
    pointer and size lists differ or whose pieces are all empty."""
    if not len(keys) == len(ptrs) == len(sizes):
        return None
    out: list[Parts | None] = []
    for p, s in zip(ptrs, sizes, strict=True):
        pieces = [(a, n) for a, n in zip(p, s, strict=True) if n != 0] \
            if len(p) == len(s) else []
        out.append(pieces or None)
    return out


__all__ = ["ErrorCode", "StoreData"]
