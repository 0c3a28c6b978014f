"""The header of a GGUF file checked as untrusted input before the `gguf` package reads it: a
sans-I/O walk over the file's bytes (any buffer: an mmap of the file, or bytes in tests) that
bounds every count and length by `GgufLimits` and by the bytes that are actually there, and
checks that each tensor has a supported type and lies inside the file. Any violation is one
CheckpointError saying what is wrong and where; nothing is allocated from a count the file
states before the count is checked.

    offset 0   "GGUF"  u32 version (2 or 3)  u64 tensor count  u64 metadata count
               metadata: {string key, u32 value type, value} x count
                   string = u64 length, bytes; array = u32 item type, u64 length, items
               tensor infos: {string name, u32 n_dims, u64 dims[n_dims], u32 type,
                              u64 offset} x count
    data_start = the end of the tensor infos rounded up to `general.alignment` (default 32);
               tensor i lies at data_start + offset_i, (dims product / block) x block bytes
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

from kvpool.errors import CheckpointError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
STRING, ARRAY, UINT32 = 8, 9, 4
SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
"""GGUF metadata value type -> bytes (uint8 ... float64, bool; 8 string, 9 array)."""
TENSOR_TYPES = {0: ("F32", 1, 4), 1: ("F16", 1, 2), 30: ("BF16", 1, 2),
                2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
                7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 10: ("Q2_K", 256, 84),
                11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176),
                14: ("Q6_K", 256, 210)}
"""The ggml tensor types kvpool imports: type id -> (name, elements per block, bytes per
block)."""


@dataclass(frozen=True)
class GgufLimits:
    """The largest counts and lengths a GGUF header may state."""

    max_tensors: int = 65536
    max_metadata: int = 65536
    max_string_bytes: int = 16 << 20
    """A metadata key or string value (a chat template is a few KiB)."""
    max_array_len: int = 16 << 20
    """A metadata array (the vocabulary, the merges)."""
    max_name_bytes: int = 256
    max_dims: int = 4


GGUF_LIMITS = GgufLimits()


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]
    """ggml order: the fastest-varying dimension first (reversed from numpy's)."""
    type_id: int
    offset: int
    """From data_start."""
    num_bytes: int


@dataclass(frozen=True)
class GgufHeader:
    version: int
    num_metadata: int
    tensors: tuple[TensorInfo, ...]
    data_start: int


class _Cursor:
    """Bounded little-endian reads from `buf`; running off its end is a CheckpointError."""

    def __init__(self, buf: Any, size: int) -> None:
        self.buf, self.size, self.pos = buf, size, 0

    def take(self, fmt: str, what: str) -> Any:
        width = struct.calcsize(fmt)
        if self.pos + width > self.size:
            raise CheckpointError(f"truncated at byte {self.pos} (reading {what}; the file has "
                                  f"{self.size} bytes)")
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += width
        return value

    def skip(self, num_bytes: int, what: str) -> None:
        if num_bytes > self.size - self.pos:
            raise CheckpointError(f"truncated at byte {self.pos} ({what} needs {num_bytes} "
                                  f"bytes; the file has {self.size})")
        self.pos += num_bytes

    def string(self, what: str, limit: int) -> bytes:
        length = self.take("<Q", f"the length of {what}")
        if length > limit:
            raise CheckpointError(f"{what} at byte {self.pos - 8} states a length of {length} "
                                  f"bytes (at most {limit})")
        start = self.pos
        self.skip(length, what)
        return bytes(self.buf[start:self.pos])


def parse_header(buf: Any, size: int, limits: GgufLimits = GGUF_LIMITS) -> GgufHeader:
    """Check the header of the GGUF file whose `size` bytes are `buf`; CheckpointError (to be
    prefixed with the file's name) for the first problem."""
    cur = _Cursor(buf, size)
    if size < 4 or bytes(buf[:4]) != MAGIC:
        raise CheckpointError(f"not a GGUF file (it starts with {bytes(buf[:4])!r}, not "
                              f"{MAGIC!r})")
    cur.pos = 4
    version = cur.take("<I", "the version")
    if version not in VERSIONS:
        raise CheckpointError(f"GGUF version {version} is not supported (only "
                              f"{' and '.join(map(str, VERSIONS))}; big-endian files neither)")
    num_tensors = _count(cur, "tensor count", limits.max_tensors)
    num_metadata = _count(cur, "metadata count", limits.max_metadata)
    alignment = DEFAULT_ALIGNMENT
    for i in range(num_metadata):
        key = cur.string(f"metadata key {i}", limits.max_string_bytes)
        kind = cur.take("<I", f"the type of {key!r}")
        if key == b"general.alignment":
            alignment = _alignment(cur, kind)
        else:
            _skip_value(cur, kind, key, limits)
    infos = [_tensor_info(cur, i, limits) for i in range(num_tensors)]
    data_start = -(-cur.pos // alignment) * alignment
    for t in infos:
        if data_start + t.offset + t.num_bytes > size:
            raise CheckpointError(f"tensor {t.name!r} lies outside the file (bytes "
                                  f"{data_start + t.offset}..{data_start + t.offset + t.num_bytes}"
                                  f" of a {size}-byte file): the file is truncated or damaged")
    return GgufHeader(version, num_metadata, tuple(infos), data_start)


def _count(cur: _Cursor, what: str, limit: int) -> int:
    value = int(cur.take("<Q", f"the {what}"))
    if value > limit:
        raise CheckpointError(f"the header states a {what} of {value} (at most {limit}): the "
                              f"file is damaged")
    return value


def _alignment(cur: _Cursor, kind: int) -> int:
    value = int(cur.take("<I", "general.alignment")) if kind == UINT32 else 0
    if value <= 0 or value & (value - 1):
        raise CheckpointError("general.alignment must be a uint32 power of two")
    return value


def _skip_value(cur: _Cursor, kind: int, key: bytes, limits: GgufLimits) -> None:
    name = key.decode("utf-8", "replace")
    if kind == STRING:
        cur.string(f"the value of {name!r}", limits.max_string_bytes)
    elif kind in SCALAR_BYTES:
        cur.skip(SCALAR_BYTES[kind], f"the value of {name!r}")
    elif kind == ARRAY:
        item = cur.take("<I", f"the item type of {name!r}")
        length = _count(cur, f"length of array {name!r}", limits.max_array_len)
        if item == STRING:
            for _ in range(length):
                cur.string(f"an item of {name!r}", limits.max_string_bytes)
        elif item in SCALAR_BYTES:
            cur.skip(SCALAR_BYTES[item] * length, f"array {name!r}")
        else:
            raise CheckpointError(f"array {name!r} has items of unknown type {item}")
    else:
        raise CheckpointError(f"metadata {name!r} has unknown value type {kind}")


def _tensor_info(cur: _Cursor, i: int, limits: GgufLimits) -> TensorInfo:
    raw = cur.string(f"the name of tensor {i}", limits.max_name_bytes)
    name = raw.decode("utf-8", "replace")
    n_dims = cur.take("<I", f"the dimension count of {name!r}")
    if not 1 <= n_dims <= limits.max_dims:
        raise CheckpointError(f"tensor {name!r} has {n_dims} dimensions (1..{limits.max_dims})")
    dims = tuple(int(cur.take("<Q", f"a dimension of {name!r}")) for _ in range(n_dims))
    type_id = cur.take("<I", f"the type of {name!r}")
    offset = int(cur.take("<Q", f"the offset of {name!r}"))
    if type_id not in TENSOR_TYPES:
        names = ", ".join(t[0] for t in TENSOR_TYPES.values())
        raise CheckpointError(f"tensor {name!r} has ggml type {type_id}, which kvpool does not "
                              f"import (supported: {names}); convert the file to one of them")
    type_name, block, block_bytes = TENSOR_TYPES[type_id]
    if min(dims) < 1 or dims[0] % block:
        raise CheckpointError(f"tensor {name!r} has dimensions {list(dims)}, not positive "
                              f"multiples of its {type_name} block ({block})")
    elements = 1
    for d in dims:
        elements *= d
    return TensorInfo(name, dims, type_id, offset, elements // block * block_bytes)
