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

import os
from collections.abc import Sequence
from dataclasses import replace

from kvpool.compat.mooncake.config import from_env
from kvpool.compat.mooncake.store_base import SETUP_FAILED, code, log, needs_setup, per_key
from kvpool.compat.mooncake.store_ranges import StoreRanges
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
from kvpool.errors import ConfigError
from kvpool.store.wire.codes import ErrorCode, LookupResult

E = ErrorCode

__all__ = [
    "BufferHandle", "Descriptor", "DiskDescriptor", "MemoryDescriptor",
    "MooncakeDistributedStore", "MooncakeHostMemAllocator", "ObjectDataType", "ReplicaDescriptor", "ReplicaStatus",
    "ReplicateConfig", "SoftPinAction", "bind_to_numa_node",
]


def _exist_value(status: ErrorCode) -> int:
    """1 stored, 0 not stored (an impossible key is not stored either), <0 failure."""
    if status is E.OK:
        return 1
    return 0 if status in (E.OBJECT_NOT_FOUND, E.INVALID_PARAMS) else int(status)


def _replicas(look: LookupResult) -> list[ReplicaDescriptor]:
    return [ReplicaDescriptor(MemoryDescriptor(Descriptor(r.size, r.addr, r.endpoint)))
            for r in look.replicas]


def bind_to_numa_node(node: int) -> None:
    """Run this thread on the CPUs of NUMA node `node` (LMCache calls it before `setup`);
    nothing happens where the node or its CPU list is unknown."""
    try:
        with open(f"/sys/devices/system/node/node{int(node)}/cpulist", encoding="ascii") as f:
            cpus = _cpu_list(f.read())
        if cpus:
            os.sched_setaffinity(0, cpus)
    except (OSError, ValueError) as exc:
        log.info("bind_to_numa_node(%s): %s; left as it was", node, exc)


def _cpu_list(text: str) -> set[int]:
    """CPUs of a Linux cpulist such as "0-3,8,10-11"."""
    cpus: set[int] = set()
    for item in text.strip().split(","):
        if item:
            low, _, high = item.partition("-")
            cpus.update(range(int(low), int(high or low) + 1))
    return cpus


class MooncakeDistributedStore(StoreRanges):
    def setup_dummy(self, mem_pool_size: int, local_buffer_size: int,
                    server_address: str, /) -> int:
        """SGLang's standalone-storage mode. Mooncake attaches to a separate `mooncake_client`
        process at `server_address` that owns the pool memory; kvpool has no such process, so
        this process joins the pool as a pure client (no segment of its own) of the master
        named by `MOONCAKE_CONFIG_PATH` / `MOONCAKE_MASTER`, with `local_buffer_size` of
        staging. The caller's host pool (`mem_pool_size` bytes, from
        `MooncakeHostMemAllocator`) is registered with `register_buffer` as usual. 0, or -1
        (no master configured, or the master is unreachable)."""
        try:
            config = replace(from_env(os.environ), global_segment_size=0,
                             local_buffer_size=int(local_buffer_size))
        except (ConfigError, TypeError, ValueError) as exc:
            log.error("setup_dummy(%s, %s, %r): kvpool has no standalone client process and "
                      "connects to the master directly, but %s", mem_pool_size,
                      local_buffer_size, server_address, exc)
            return SETUP_FAILED
        return self._start(config)

    # -- existence, size, removal ----------------------------------------------------------

    @needs_setup(code)
    def is_exist(self, key: str, /) -> int:
        return self.batch_is_exist([key])[0]

    @needs_setup(per_key)
    def batch_is_exist(self, keys: Sequence[str]) -> list[int]:
        """1 / 0 / <0 per key. Asked as a replica lookup so that, as in Mooncake, a found
        object gets a read lease (kvpool's plain exists does not grant one)."""
        return [_exist_value(look.code) for look in self.client.replica_desc_batch(list(keys))]

    @needs_setup(per_key)
    def batch_is_exist_no_lease(self, keys: Sequence[str]) -> list[int]:
        """1 / 0 / <0 per key, like `batch_is_exist` but granting no read lease (so a
        lookup never delays the object's eviction or removal)."""
        return [_exist_value(status) for status in self.client.batch_exists(list(keys))]

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
