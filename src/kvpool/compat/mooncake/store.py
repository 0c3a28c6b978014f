"""`mooncake.store` on kvpool: `MooncakeDistributedStore`, `ReplicateConfig` and the enums and
descriptor types callers touch.

    store = MooncakeDistributedStore()
    store.setup("127.0.0.1", "P2PHANDSHAKE", 512 << 20, 128 << 20, "tcp", "", "127.0.0.1:50051")
    store.register_buffer(kv.data_ptr(), kv.nbytes)
    store.batch_put_from_multi_buffers(keys, ptrs_per_key, sizes_per_key)
    store.close()

Integer results are Mooncake's: 0 or a count on success, negative codes on failure (-200 no
space, -600 bad arguments, -704 not found, -706 leased, -800 transfer failed, -900 RPC).
Arguments Mooncake takes only positionally are positional-only here as well.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

from kvpool.compat.mooncake import tensor_codec
from kvpool.compat.mooncake.store_base import INVALID, code, log, needs_setup, per_key
from kvpool.compat.mooncake.store_data import StoreData
from kvpool.compat.mooncake.types import (
    BufferHandle,
    Descriptor,
    DiskDescriptor,
    MemoryDescriptor,
    MooncakeHostMemAllocator,
    ObjectDataType,
    ReplicaDescriptor,
    ReplicaStatus,
    ReplicateConfig,
    SoftPinAction,
)
from kvpool.store.codes import ErrorCode, LookupResult

E = ErrorCode

__all__ = [
    "BufferHandle", "Descriptor", "DiskDescriptor", "MemoryDescriptor",
    "MooncakeDistributedStore", "MooncakeHostMemAllocator", "ObjectDataType", "ReplicaDescriptor", "ReplicaStatus",
    "ReplicateConfig", "SoftPinAction",
]


def _exist_value(status: ErrorCode) -> int:
    """1 stored, 0 not stored (an impossible key is not stored either), <0 failure."""
    if status is E.OK:
        return 1
    return 0 if status in (E.OBJECT_NOT_FOUND, E.INVALID_PARAMS) else int(status)


def _replicas(look: LookupResult) -> list[ReplicaDescriptor]:
    return [ReplicaDescriptor(MemoryDescriptor(Descriptor(r.size, r.addr, r.endpoint)))
            for r in look.replicas]


class MooncakeDistributedStore(StoreData):
    # -- existence, size, removal ----------------------------------------------------------

    @needs_setup(code)
    def is_exist(self, key: str, /) -> int:
        return self.batch_is_exist([key])[0]

    @needs_setup(per_key)
    def batch_is_exist(self, keys: Sequence[str]) -> list[int]:
        """1 / 0 / <0 per key. Asked as a replica lookup so that, as in Mooncake, a found
        object gets a read lease (kvpool's plain exists does not grant one)."""
        return [_exist_value(look.code) for look in self.client.replica_desc_batch(list(keys))]

    @needs_setup(code)
    def get_size(self, key: str, /) -> int:
        result = self.client.size(key)
        return result.size if result.code is E.OK else int(result.code)

    @needs_setup(code)
    def remove(self, key: str, force: bool = False) -> int:
        """0, -704 when missing, -706 while a read lease holds it (unless `force`)."""
        return int(self.client.remove(key, force))

    @needs_setup(per_key)
    def batch_remove(self, keys: Sequence[str], force: bool = False) -> list[int]:
        return [int(c) for c in self.client.batch_remove(list(keys), force)]

    @needs_setup(code)
    def remove_by_regex(self, regex_pattern: str, force: bool = False) -> int:
        """Number of objects removed (leased ones are kept unless `force`), or -600."""
        return self.client.remove_regex(regex_pattern, force)

    @needs_setup(code)
    def remove_all(self, force: bool = False) -> int:
        return self.client.remove_all(force)

    # -- where replicas live -----------------------------------------------------------------

    def get_replica_desc(self, key: str) -> list[ReplicaDescriptor]:
        """The object's replicas; [] when it is missing."""
        if self._client is None:
            return []
        return _replicas(self._client.replica_desc(key))

    def batch_get_replica_desc(self, keys: Sequence[str]) -> dict[str, list[ReplicaDescriptor]]:
        """key -> replicas, for the keys that are stored (missing keys are left out)."""
        if self._client is None:
            return {}
        looks = self._client.replica_desc_batch(list(keys))
        return {k: _replicas(look) for k, look in zip(keys, looks, strict=True)
                if look.code is E.OK}

    # -- torch tensors -----------------------------------------------------------------------

    def put_tensor(self, key: str, tensor: Any) -> int:
        return self.batch_put_tensor([key], [tensor])[0]

    def upsert_tensor(self, key: str, tensor: Any) -> int:
        return self._put_tensors([key], [tensor], None, upsert=True)[0]

    def pub_tensor(self, key: str, tensor: Any, config: ReplicateConfig | None = None) -> int:
        return self._put_tensors([key], [tensor], config, upsert=False)[0]

    def batch_put_tensor(self, keys: Sequence[str], tensors_list: Sequence[Any]) -> list[int]:
        return self._put_tensors(keys, tensors_list, None, upsert=False)

    def batch_upsert_tensor(self, keys: Sequence[str], tensors_list: Sequence[Any]) -> list[int]:
        return self._put_tensors(keys, tensors_list, None, upsert=True)

    def batch_pub_tensor(self, keys: Sequence[str], tensors_list: Sequence[Any],
                         config: ReplicateConfig | None = None) -> list[int]:
        return self._put_tensors(keys, tensors_list, config, upsert=False)

    @needs_setup(per_key)
    def _put_tensors(self, keys: Sequence[str], tensors: Sequence[Any],
                     config: ReplicateConfig | None, upsert: bool) -> list[int]:
        if len(keys) != len(tensors):
            return [INVALID] * len(keys)
        values: list[bytes | None] = []
        for tensor in tensors:
            try:
                values.append(tensor_codec.encode_header(tensor)
                              + tensor_codec.payload_of(tensor).tobytes())
            except (AttributeError, TypeError, ValueError, RuntimeError) as exc:
                log.warning("cannot store tensor: %s", exc)
                values.append(None)
        return self._put_values(keys, values, config, upsert)

    def get_tensor(self, key: str) -> Any | None:
        """The tensor stored under `key`, or None when missing or not a tensor."""
        return self.batch_get_tensor([key])[0]

    def batch_get_tensor(self, keys: Sequence[str]) -> list[Any | None]:
        if self._client is None:
            return [None] * len(keys)
        return [tensor_codec.decode(r.data) if r.ok else None
                for r in self._client.get_batch(list(keys))]

    def get_tensor_into(self, key: str, buffer_ptr: int, size: int) -> Any | None:
        """Read the whole object (header and data) into the registered buffer and return a
        tensor viewing its data part; None on any failure."""
        return self.batch_get_tensor_into([key], [buffer_ptr], [size])[0]

    def batch_get_tensor_into(self, keys: Sequence[str], buffer_ptrs: Sequence[int],
                              sizes: Sequence[int]) -> list[Any | None]:
        if self._client is None or not len(keys) == len(buffer_ptrs) == len(sizes):
            return [None] * len(keys)
        read = self.batch_get_into(keys, buffer_ptrs, sizes)
        return [_tensor_at(ptr, n) if n > 0 else None
                for ptr, n in zip(buffer_ptrs, read, strict=True)]


def _tensor_at(ptr: int, num_bytes: int) -> Any | None:
    if num_bytes < tensor_codec.HEADER_BYTES:
        return None
    raw = (ctypes.c_ubyte * num_bytes).from_address(ptr)
    head = tensor_codec.decode_header(memoryview(raw).cast("B"))
    if head is None:
        return None
    data = (ctypes.c_ubyte * (num_bytes - tensor_codec.HEADER_BYTES)).from_address(
        ptr + tensor_codec.HEADER_BYTES)
    return tensor_codec.tensor_from(data, *head)


UNDEFINED, INITIALIZED, PROCESSING, COMPLETE, REMOVED, FAILED = tuple(ReplicaStatus)
(UNKNOWN, KVCACHE, TENSOR, WEIGHT, SAMPLE, ACTIVATION, GRADIENT, OPTIMIZER_STATE, METADATA,
 GENERAL) = tuple(ObjectDataType)
