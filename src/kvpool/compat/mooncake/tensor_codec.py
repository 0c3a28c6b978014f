"""How a torch tensor is stored as one object, in Mooncake's layout: a 304-byte header, then
the tensor's bytes (C order). Tensors put by kvpool are read by Mooncake and the other way
round (tests/compat checks it against the wheel's own serializer).

    offset 0       4      6       8       12     16        24         32         40
           | "NOOM" | ver=1 | hdr=304 | dtype | ndim | sharded | data_off | data_len |
           | 40: shape, 8 x i64 (-1 past ndim)      | 104: local shape, 8 x i64       |
           | 168: 1 | 176: 1 | 184: rank u32 | 188: size u32 | 192: split_dim u32 |
           | 200: local extent along split_dim u64  | zeros up to 304 | data ...      |

All integers little-endian. For a whole tensor `sharded` is 0, both shapes are the shape and
bytes 168..303 are zero. A tensor-parallel shard (`put_tensor_with_tp`) has `sharded` 1, the
full tensor's shape at 40, the shard's at 104, and the shard description from 168 (the two
fields that read 1 in every shard Mooncake 0.3.13 writes are written as 1). Readers use the
dtype, ndim, local shape and data offset and length. Pure functions over bytes, no I/O.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

HEADER_BYTES = 304
MAGIC = b"NOOM"
VERSION = 1
MAX_DIMS = 8
_HEAD = struct.Struct("<4sHHiiIxxxxQQ8q8q")
_SHARD = struct.Struct("<QQIIIxxxxQ")
_SHARD_AT = 168
_DTYPE_NAMES = ("float32", "float64", "int8", "uint8", "int16", "uint16", "int32", "uint32",
                "int64", "uint64", "bool", "float16", "bfloat16", "float8_e4m3fn",
                "float8_e5m2")
"""Mooncake's dtype codes are the indices (complex dtypes are not storable there either)."""


@dataclass(frozen=True)
class Shard:
    """Which part of a tensor a stored shard is: `rank` of `size` along `split_dim`."""
    rank: int
    size: int
    split_dim: int
    extent: int
    """The shard's length along split_dim."""


def _torch() -> Any:
    import torch

    return torch


def _dtype_code(dtype: Any) -> int:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPE_NAMES:
        raise ValueError(f"tensor dtype {dtype} cannot be stored (supported: {_DTYPE_NAMES})")
    return _DTYPE_NAMES.index(name)


def _dims(shape: tuple[int, ...]) -> tuple[int, ...]:
    if len(shape) > MAX_DIMS:
        raise ValueError(f"tensor has {len(shape)} dimensions; at most {MAX_DIMS} are stored")
    return shape + (-1,) * (MAX_DIMS - len(shape))


def encode_header(tensor: Any, full_shape: tuple[int, ...] | None = None,
                  shard: Shard | None = None) -> bytes:
    """The header for `tensor` (or for `tensor` as `shard` of a tensor of `full_shape`);
    ValueError for an unsupported dtype or too many dimensions."""
    shape = tuple(int(d) for d in tensor.shape)
    data_len = int(tensor.numel()) * int(tensor.element_size())
    head = _HEAD.pack(MAGIC, VERSION, HEADER_BYTES, _dtype_code(tensor.dtype), len(shape),
                      int(shard is not None), HEADER_BYTES, data_len,
                      *_dims(full_shape or shape), *_dims(shape))
    tail = b"" if shard is None else _SHARD.pack(1, 1, shard.rank, shard.size,
                                                  shard.split_dim, shard.extent)
    body = head + bytes(_SHARD_AT - len(head)) + tail
    return body + bytes(HEADER_BYTES - len(body))


@dataclass(frozen=True)
class Header:
    dtype: Any
    shape: tuple[int, ...]
    """The stored tensor's own shape (a shard's local shape)."""
    data_offset: int
    data_len: int


def decode_header(raw: bytes | bytearray | memoryview) -> Header | None:
    """The header at the start of an object, or None when it is not a tensor header."""
    if len(raw) < _HEAD.size:
        return None
    magic, version, header_len, dtype_code, ndim, _, offset, data_len, *dims = \
        _HEAD.unpack_from(raw)
    if (magic != MAGIC or version != VERSION or not 0 <= ndim <= MAX_DIMS
            or not 0 <= dtype_code < len(_DTYPE_NAMES) or offset < header_len
            or header_len < _HEAD.size):
        return None
    shape = tuple(dims[MAX_DIMS:MAX_DIMS + ndim])
    if any(d < 0 for d in shape):
        return None
    return Header(getattr(_torch(), _DTYPE_NAMES[dtype_code]), shape, offset, data_len)


def payload_of(tensor: Any) -> memoryview:
    """The tensor's bytes (a CPU, contiguous copy when needed), without another copy."""
    cpu = tensor.detach().to("cpu").contiguous()
    if not cpu.numel():
        return memoryview(b"")
    return memoryview(cpu.reshape(-1).view(_torch().uint8).numpy()).cast("B")


def encode(tensor: Any, full_shape: tuple[int, ...] | None = None,
           shard: Shard | None = None) -> bytes:
    """A whole object: header and data."""
    return encode_header(tensor, full_shape, shard) + payload_of(tensor).tobytes()


def tensor_from(raw: Any, dtype: Any, shape: tuple[int, ...]) -> Any | None:
    """A tensor viewing `raw` (a writable buffer holding exactly the data), or None when the
    size does not match the header."""
    torch = _torch()
    itemsize = torch.empty((), dtype=dtype).element_size()
    count = 1
    for d in shape:
        count *= d
    if memoryview(raw).nbytes != count * itemsize:
        return None
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(raw, dtype=dtype).reshape(shape)


def decode(raw: bytes | bytearray) -> Any | None:
    """A tensor from a whole stored object (copied into memory the tensor owns)."""
    head = decode_header(raw)
    if head is None or head.data_offset + head.data_len != len(raw):
        return None
    data = bytearray(memoryview(raw)[head.data_offset:])
    return tensor_from(data, head.dtype, head.shape)


def split(tensor: Any, size: int, split_dim: int) -> list[tuple[Any, Shard]] | None:
    """The `size` equal shards of `tensor` along `split_dim` (contiguous copies), or None when
    the dimension does not divide evenly or does not exist (Mooncake refuses those too)."""
    if size < 1 or not 0 <= split_dim < tensor.dim() or tensor.shape[split_dim] % size:
        return None
    extent = int(tensor.shape[split_dim]) // size
    return [(part.contiguous(), Shard(rank, size, split_dim, extent))
            for rank, part in enumerate(tensor.split(extent, dim=split_dim))]


def shard_key(key: str, rank: int) -> str:
    """Where shard `rank` of a tensor-parallel tensor is stored."""
    return f"{key}_tp_{rank}"
