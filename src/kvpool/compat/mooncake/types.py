"""Value types of Mooncake's store API: ReplicateConfig, its enums, buffer handles and
replica descriptors, with Mooncake's attribute and method names.

`ReplicateConfig` is mutable like Mooncake's (callers set fields after construction and probe
them with `hasattr`); unknown attributes raise AttributeError, as they do there.
"""

from __future__ import annotations

import ctypes
import enum
from typing import Any

from kvpool.store.config import ReplicateConfig as NativeReplicateConfig


class SoftPinAction(enum.IntEnum):
    PRESERVE = 0
    ENABLE = 1
    DISABLE = 2


class ReplicaStatus(enum.IntEnum):
    UNDEFINED = 0
    INITIALIZED = 1
    PROCESSING = 2
    COMPLETE = 3
    REMOVED = 4
    FAILED = 5


class ObjectDataType(enum.IntEnum):
    UNKNOWN = 0
    KVCACHE = 1
    TENSOR = 2
    WEIGHT = 3
    SAMPLE = 4
    ACTIVATION = 5
    GRADIENT = 6
    OPTIMIZER_STATE = 7
    METADATA = 8
    GENERAL = 9


_DEFAULTS: dict[str, Any] = {
    "replica_num": 1,
    "nof_replica_num": 0,
    "dfs_replica_num": 0,
    "with_hard_pin": False,
    "preferred_segment": "",
    "preferred_segments": [],
    "preferred_nof_segments": [],
    "prefer_alloc_in_same_node": False,
    "soft_pin_action": SoftPinAction.PRESERVE,
    "soft_pin_ttl_ms": None,
    "group_ids": None,
    "data_type": ObjectDataType.UNKNOWN,
}


class ReplicateConfig:
    """How one put is placed. Fields as in Mooncake; keyword arguments to the constructor are
    accepted as a convenience (Mooncake's constructor takes none)."""

    __slots__ = tuple(_DEFAULTS)
    replica_num: int
    nof_replica_num: int
    dfs_replica_num: int
    with_hard_pin: bool
    preferred_segment: str
    preferred_segments: list[str]
    preferred_nof_segments: list[str]
    prefer_alloc_in_same_node: bool
    soft_pin_action: SoftPinAction
    soft_pin_ttl_ms: int | None
    group_ids: list[int] | None
    data_type: ObjectDataType

    def __init__(self, **fields: Any) -> None:
        for name, default in _DEFAULTS.items():
            value = list(default) if isinstance(default, list) else default
            setattr(self, name, value)
        for name, value in fields.items():
            if name not in _DEFAULTS:
                raise TypeError(f"ReplicateConfig has no field {name!r}")
            setattr(self, name, value)

    def to_native(self) -> NativeReplicateConfig:
        """The kvpool store's config; raises ValueError (ConfigError) for a bad replica_num."""
        preferred = tuple(str(s) for s in (self.preferred_segments or ()))
        return NativeReplicateConfig(
            replica_num=int(self.replica_num), with_hard_pin=bool(self.with_hard_pin),
            with_soft_pin=int(self.soft_pin_action) == SoftPinAction.ENABLE,
            preferred_segment=str(self.preferred_segment or ""), preferred_segments=preferred)

    def __str__(self) -> str:
        ttl = "default" if self.soft_pin_ttl_ms is None else str(self.soft_pin_ttl_ms)
        return (f"ReplicateConfig: {{ replica_num: {self.replica_num}, soft_pin_action: "
                f"{SoftPinAction(int(self.soft_pin_action)).name}, soft_pin_ttl_ms: {ttl}, "
                f"with_hard_pin: {int(bool(self.with_hard_pin))}, preferred_segments: "
                f"{list(self.preferred_segments)} }}")

    __repr__ = __str__


class BufferHandle(bytearray):
    """The bytes of one object, owned by the caller: buffer protocol, `ptr()`, `size()`."""

    def ptr(self) -> int:
        if not self:
            return 0
        return ctypes.addressof((ctypes.c_char * len(self)).from_buffer(self))

    def size(self) -> int:
        return len(self)


class Descriptor:
    """Where a memory replica's bytes are: Mooncake's buffer descriptor fields."""

    def __init__(self, size: int, buffer_address: int, transport_endpoint: str) -> None:
        self.size = size
        self.buffer_address = buffer_address
        self.transport_endpoint = transport_endpoint

    def __repr__(self) -> str:
        return (f"<Descriptor size={self.size} buffer_address={self.buffer_address} "
                f"transport_endpoint={self.transport_endpoint}>")


class MemoryDescriptor:
    def __init__(self, buffer_descriptor: Descriptor) -> None:
        self.buffer_descriptor = buffer_descriptor


class DiskDescriptor:
    def __init__(self, file_path: str, object_size: int) -> None:
        self.file_path = file_path
        self.object_size = object_size


class ReplicaDescriptor:
    """One replica of an object: in memory (kvpool keeps every replica in a DRAM segment)."""

    def __init__(self, memory: MemoryDescriptor | None, disk: DiskDescriptor | None = None,
                 status: ReplicaStatus = ReplicaStatus.COMPLETE) -> None:
        self._memory = memory
        self._disk = disk
        self.status = status

    def is_memory_replica(self) -> bool:
        return self._memory is not None

    def is_disk_replica(self) -> bool:
        return self._disk is not None

    def is_local_disk_replica(self) -> bool:
        return False

    def get_memory_descriptor(self) -> MemoryDescriptor:
        if self._memory is None:
            raise RuntimeError("not a memory replica")
        return self._memory

    def get_disk_descriptor(self) -> DiskDescriptor:
        if self._disk is None:
            raise RuntimeError("not a disk replica")
        return self._disk

    def __repr__(self) -> str:
        where = self._memory.buffer_descriptor if self._memory else self._disk
        return f"<ReplicaDescriptor {self.status.name} {where!r}>"


class MooncakeHostMemAllocator:
    """Page-aligned host memory by address (`alloc(size) -> ptr`, 0 on failure;
    `free(ptr) -> 0 | -1`). The memory stays valid until freed or the allocator is dropped."""

    def __init__(self) -> None:
        self._blocks: dict[int, Any] = {}

    def alloc(self, size: int, /) -> int:
        if type(size) is not int or size <= 0:
            return 0
        import mmap

        try:
            block = mmap.mmap(-1, size)
        except (OSError, ValueError, OverflowError):
            return 0
        addr = ctypes.addressof(ctypes.c_char.from_buffer(block))
        self._blocks[addr] = block
        return addr

    def free(self, ptr: int, /) -> int:
        block = self._blocks.pop(ptr, None)
        if block is None:
            return -1
        try:
            block.close()
        except BufferError:
            self._blocks[ptr] = block  # still viewed by a live tensor; keep it mapped
            return -1
        return 0
