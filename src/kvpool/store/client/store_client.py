"""The store client library: put and get KV blocks in the pool.

    with StoreClient(ClientConfig(master="127.0.0.1:50051")) as store:
        store.put("block-1", b"...")            # PutResult
        store.get("block-1").data               # GetResult
        buf = store.register_buffer(array)      # zero-copy
        store.batch_put_from(keys, addrs, sizes)

Every call returns typed results carrying an ErrorCode (Mooncake's integer codes); nothing
raises for expected outcomes (missing object, no space, a dead peer). Misuse of the API
(a closed client, unregistered memory in a raw address) raises from kvpool.errors.
Thread-safe: calls are serialized on one master connection.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvpool.errors import RpcFailed
from kvpool.store.client.base import ClientBase
from kvpool.store.client.plan import Part
from kvpool.store.client.reads import read_ok
from kvpool.store.config import ReplicateConfig
from kvpool.store.wire import messages as m
from kvpool.store.wire.codes import ErrorCode, GetResult, LookupResult, PutResult, ReadResult
from kvpool.store.wire.validate import valid_key

E = ErrorCode
DEFAULT = ReplicateConfig()


@dataclass(frozen=True, slots=True)
class SizeResult:
    code: ErrorCode
    size: int = 0


class StoreClient(ClientBase):
    # -- bytes API (staged through the local buffer) -----------------------------------------

    def put(self, key: str, value: bytes | bytearray | memoryview,
            config: ReplicateConfig = DEFAULT) -> PutResult:
        return self.put_batch([key], [value], config)[0]

    def upsert(self, key: str, value: bytes | bytearray | memoryview,
               config: ReplicateConfig = DEFAULT) -> PutResult:
        return self.put_batch([key], [value], config, upsert=True)[0]

    def put_batch(self, keys: Sequence[str], values: Sequence[Any],
                  config: ReplicateConfig = DEFAULT, upsert: bool = False) -> list[PutResult]:
        if len(keys) != len(values):
            return [PutResult(E.INVALID_PARAMS)] * max(len(keys), len(values))
        staged = []
        try:
            parts: list[list[Part]] = []
            for value in values:
                view = memoryview(value).cast("B")
                addr, dst, token = self._staging.acquire(view.nbytes)
                staged.append(token)
                dst[:] = view
                parts.append([(addr, view.nbytes)])
            return self._write(keys, parts, config, upsert)
        finally:
            for token in staged:
                self._staging.release(token)

    def put_parts(self, key: str, *values: Any, config: ReplicateConfig = DEFAULT) -> PutResult:
        """One object from several byte strings, concatenated."""
        return self.put(key, b"".join(memoryview(v).cast("B") for v in values), config)

    def get(self, key: str) -> GetResult:
        return self.get_batch([key])[0]

    def get_batch(self, keys: Sequence[str]) -> list[GetResult]:
        looked = None
        if (last := self._last_place(keys)) is not None:
            addr, view, token = self._staging.acquire(last[0])
            try:
                early = self._read_early(keys[0], last, [(addr, last[0])])
                if early is not None and early[2]:
                    return [GetResult(E.OK, bytes(view[:early[0].size]))]
            finally:
                self._staging.release(token)
            looked = _looked(early)
        looks, t0 = looked or self._lookup(keys)
        staged: list[tuple[memoryview, Any] | None] = []
        parts: list[list[Part] | None] = []
        try:
            for look in looks:
                if look.code != E.OK:
                    staged.append(None)
                    parts.append(None)
                    continue
                addr, view, token = self._staging.acquire(look.size)
                staged.append((view, token))
                parts.append([(addr, look.size)])
            reads = self._read_relooked(keys, looks, parts, t0)
            return [GetResult(r.code, bytes(s[0]) if r.ok and s else b"")
                    for r, s in zip(reads, staged, strict=True)]
        finally:
            for s in staged:
                if s is not None:
                    self._staging.release(s[1])

    # -- zero-copy API (registered buffers) --------------------------------------------------

    def register_buffer(self, obj: Any, length: int | None = None) -> Any:
        """Register a numpy array, torch CPU tensor or bytes-like object (or, with `length`,
        a raw address) so put_from/get_into can use it. Returns the engine's Buffer."""
        if length is not None:
            return self.engine.register_address(int(obj), length)
        return self.engine.register(obj)

    def unregister_buffer(self, addr: int) -> None:
        self.engine.unregister(addr)

    def put_from(self, key: str, addr: int, size: int,
                 config: ReplicateConfig = DEFAULT) -> PutResult:
        return self._write([key], [[(addr, size)]], config, False)[0]

    def batch_put_from(self, keys: Sequence[str], addrs: Sequence[int], sizes: Sequence[int],
                       config: ReplicateConfig = DEFAULT, upsert: bool = False) -> list[PutResult]:
        if not len(keys) == len(addrs) == len(sizes):
            return [PutResult(E.INVALID_PARAMS)] * max(len(keys), len(addrs), len(sizes))
        return self._write(keys, [[(a, s)] for a, s in zip(addrs, sizes, strict=True)],
                           config, upsert)

    def batch_put_from_parts(self, keys: Sequence[str], parts: Sequence[Sequence[Part]],
                             config: ReplicateConfig = DEFAULT,
                             upsert: bool = False) -> list[PutResult]:
        """Scatter/gather put: object i is the concatenation of its (addr, size) parts."""
        if len(keys) != len(parts):
            return [PutResult(E.INVALID_PARAMS)] * max(len(keys), len(parts))
        return self._write(keys, parts, config, upsert)

    def get_into(self, key: str, addr: int, size: int) -> ReadResult:
        return self.batch_get_into([key], [addr], [size])[0]

    def batch_get_into(self, keys: Sequence[str], addrs: Sequence[int],
                       sizes: Sequence[int]) -> list[ReadResult]:
        if not len(keys) == len(addrs) == len(sizes):
            return [ReadResult(E.INVALID_PARAMS)] * max(len(keys), len(addrs), len(sizes))
        return self.batch_get_into_parts(keys, [[(a, s)] for a, s in zip(addrs, sizes,
                                                                          strict=True)])

    def batch_get_into_parts(self, keys: Sequence[str],
                             parts: Sequence[Sequence[Part]]) -> list[ReadResult]:
        """Scatter/gather get: object i is spread over its parts in order; the parts must
        hold at least the object's size (INVALID_PARAMS otherwise)."""
        if len(keys) != len(parts):
            return [ReadResult(E.INVALID_PARAMS)] * max(len(keys), len(parts))
        looked = None
        if (last := self._last_place(keys)) is not None:
            early = self._read_early(keys[0], last, parts[0])
            if early is not None and early[2]:
                return [read_ok(early[0].size)]
            looked = _looked(early)
        looks, t0 = looked or self._lookup(keys)
        return self._read_relooked(keys, looks, parts, t0)

    # -- metadata operations -----------------------------------------------------------------

    def exists(self, key: str) -> ErrorCode:
        """OK when the key is stored, OBJECT_NOT_FOUND when not, or the failure."""
        return self.batch_exists([key])[0]

    def batch_exists(self, keys: Sequence[str]) -> list[ErrorCode]:
        return self._keyed(keys, lambda chunk: m.ExistsMsg(keys=chunk))

    def size(self, key: str) -> SizeResult:
        return self.batch_size([key])[0]

    def batch_size(self, keys: Sequence[str]) -> list[SizeResult]:
        """Object sizes (a replica lookup: it grants a read lease, like Mooncake's)."""
        return [SizeResult(look.code, look.size) for look in self.replica_desc_batch(keys)]

    def replica_desc(self, key: str) -> LookupResult:
        return self.replica_desc_batch([key])[0]

    def replica_desc_batch(self, keys: Sequence[str]) -> list[LookupResult]:
        """Where each object's replicas live (this lookup grants a read lease)."""
        return self._lookup(keys)[0]

    def leased_lookup(self, keys: Sequence[str]) -> tuple[list[LookupResult], float]:
        """`replica_desc_batch`, and the clock reading each lookup's `lease_ttl_s` counts
        from (taken before it was asked for): bytes read from a replica after
        `t0 + lease_ttl_s` may be another object's (its memory reused) and must not be
        trusted."""
        return self._lookup(keys)

    def remove(self, key: str, force: bool = False) -> ErrorCode:
        return self.batch_remove([key], force)[0]

    def batch_remove(self, keys: Sequence[str], force: bool = False) -> list[ErrorCode]:
        self._places.forget(keys)  # (no early read from where a removed key was)
        return self._keyed(keys, lambda chunk: m.RemoveMsg(keys=chunk, force=force))

    def remove_all(self, force: bool = False) -> int:
        """Number of objects removed, or a negative ErrorCode."""
        self._places.clear()
        try:
            return int(self._call(m.RemoveAllMsg(force=force)))
        except RpcFailed as exc:
            return int(exc.code)

    def remove_regex(self, pattern: str, force: bool = False) -> int:
        self._places.clear()  # (whichever keys the pattern names)
        try:
            return int(self._call(m.RemoveRegexMsg(pattern=pattern, force=force)))
        except RpcFailed as exc:
            return int(exc.code)

    def _keyed(self, keys: Sequence[str],
               make: Callable[[list[str]], m.Msg]) -> list[ErrorCode]:
        """Per-key codes of a keyed request (`make(chunk)` builds it); invalid keys are
        INVALID_PARAMS without asking."""
        out = [E.INVALID_PARAMS] * len(keys)
        valid = [i for i, k in enumerate(keys) if valid_key(k)]
        if valid:
            codes = self._call_keyed([keys[i] for i in valid],
                                     lambda chunk, lo, hi: make(chunk), lambda c: c)
            for i, code in zip(valid, codes, strict=True):
                out[i] = code
        return out

    def __enter__(self) -> StoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _looked(early: tuple[LookupResult, float, bool] | None) -> tuple[list[LookupResult],
                                                                      float] | None:
    """The lookup an early read made, for the ordinary read that follows it: None when there
    was none, or when its object is still being loaded from disk (`_lookup` waits that out)."""
    if early is None or early[0].code == E.REPLICA_IS_NOT_READY:
        return None
    return [early[0]], early[1]
