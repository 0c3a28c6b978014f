"""How a torch tensor is stored as one object: a fixed 128-byte header, then the raw bytes.

    offset 0        4       6       8       12      16                  80        128
           | "KVPT" | ver u16| dtype | ndim  | pad   | shape: 8 x int64  | zeros   | data...

Pure functions over bytes (no store, no I/O). The layout is kvpool's own: objects written by
kvpool's `put_tensor` are read by kvpool's `get_tensor*`, never by Mooncake.
"""

from __future__ import annotations

import struct
from typing import Any

HEADER_BYTES = 128
MAGIC = b"KVPT"
VERSION = 1
MAX_DIMS = 8
_HEAD = struct.Struct("<4sHHI4x8q")
_DTYPE_NAMES = ("float32", "float64", "float16", "bfloat16", "int8", "uint8", "int16",
                "int32", "int64", "bool", "complex64", "complex128")


def _torch() -> Any:
    import torch

    return torch


def _dtype_code(dtype: Any) -> int:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPE_NAMES:
        raise ValueError(f"tensor dtype {dtype} cannot be stored (supported: {_DTYPE_NAMES})")
    return _DTYPE_NAMES.index(name)


def encode_header(tensor: Any) -> bytes:
    """The header for `tensor`; ValueError for an unsupported dtype or too many dimensions."""
    shape = tuple(int(d) for d in tensor.shape)
    if len(shape) > MAX_DIMS:
        raise ValueError(f"tensor has {len(shape)} dimensions; at most {MAX_DIMS} are stored")
    dims = shape + (0,) * (MAX_DIMS - len(shape))
    head = _HEAD.pack(MAGIC, VERSION, _dtype_code(tensor.dtype), len(shape), *dims)
    return head + bytes(HEADER_BYTES - len(head))


def decode_header(raw: bytes | bytearray | memoryview) -> tuple[Any, tuple[int, ...]] | None:
    """(torch dtype, shape) from the first HEADER_BYTES of an object, or None when they are
    not a tensor header."""
    if len(raw) < HEADER_BYTES:
        return None
    magic, version, dtype_code, ndim, *dims = _HEAD.unpack_from(raw)
    if magic != MAGIC or version != VERSION or ndim > MAX_DIMS or dtype_code >= len(_DTYPE_NAMES):
        return None
    return getattr(_torch(), _DTYPE_NAMES[dtype_code]), tuple(dims[:ndim])


def payload_of(tensor: Any) -> memoryview:
    """The tensor's bytes (a CPU, contiguous copy when needed), without another copy."""
    cpu = tensor.detach().to("cpu").contiguous()
    if not cpu.numel():
        return memoryview(b"")
    return memoryview(cpu.reshape(-1).view(_torch().uint8).numpy()).cast("B")


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
    if head is None:
        return None
    dtype, shape = head
    return tensor_from(bytearray(memoryview(raw)[HEADER_BYTES:]), dtype, shape)
