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

from collections.abc import Sequence

from kvpool.compat.mooncake.store_base import code, needs_setup, per_key
from kvpool.compat.mooncake.store_tensors import StoreTensors
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


class MooncakeDistributedStore(StoreTensors):
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


UNDEFINED, INITIALIZED, PROCESSING, COMPLETE, REMOVED, FAILED = tuple(ReplicaStatus)
(UNKNOWN, KVCACHE, TENSOR, WEIGHT, SAMPLE, ACTIVATION, GRADIENT, OPTIMIZER_STATE, METADATA,
 GENERAL) = tuple(ObjectDataType)
