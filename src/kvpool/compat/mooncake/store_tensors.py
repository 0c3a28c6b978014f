"""Torch tensors in the compat store: whole tensors, tensor-parallel shards and tensors laid
out in caller buffers, all in Mooncake's object layout (tensor_codec.py).

Mooncake's conventions: tensor puts are immutable like byte puts (0 for an existing key, the
old value stays; `upsert_*` replaces); getters answer None for a missing key, a non-tensor
object or a buffer too small. `put_tensor_with_tp(key, t, tp_rank, tp_size, split_dim)`
stores every shard, `key_tp_<rank>` for each rank (`tp_rank` is not used by a put), and the
whole tensor under `key` when `tp_size` is 1; a dimension that does not divide evenly is -600.
`get_tensor_with_tp(key, tp_rank, tp_size)` reads shard `tp_rank` (or `key` when `tp_size` is 1).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

from kvpool.compat.mooncake import tensor_codec as codec
from kvpool.compat.mooncake.store_base import INVALID, log, needs_setup, per_key
from kvpool.compat.mooncake.store_data import StoreData
from kvpool.compat.mooncake.types import ReplicateConfig

_BAD_TENSOR = (AttributeError, TypeError, ValueError, RuntimeError)


def _encoded(tensor: Any) -> bytes | None:
    try:
        return codec.encode(tensor)
    except _BAD_TENSOR as exc:
        log.warning("cannot store tensor: %s", exc)
        return None


def _tp_objects(key: str, tensor: Any, tp_size: int,
                split_dim: int) -> list[tuple[str, bytes]] | None:
    """(key, object) for every shard, or None when the tensor cannot be split so."""
    if tp_size == 1:
        value = _encoded(tensor)
        return None if value is None else [(key, value)]
    try:
        shards = codec.split(tensor, tp_size, split_dim)
        if shards is None:
            return None
        full = tuple(int(d) for d in tensor.shape)
        return [(codec.shard_key(key, s.rank), codec.encode(part, full, s))
                for part, s in shards]
    except _BAD_TENSOR as exc:
        log.warning("cannot store tensor shards: %s", exc)
        return None


def _tensor_at(ptr: int, num_bytes: int) -> Any | None:
    """A tensor viewing the data part of an object read into memory at `ptr`."""
    if num_bytes <= 0:
        return None
    raw = (ctypes.c_ubyte * num_bytes).from_address(ptr)
    head = codec.decode_header(memoryview(raw).cast("B"))
    if head is None or head.data_offset + head.data_len != num_bytes:
        return None
    data = (ctypes.c_ubyte * head.data_len).from_address(ptr + head.data_offset)
    return codec.tensor_from(data, head.dtype, head.shape)


class StoreTensors(StoreData):
    # -- whole tensors ---------------------------------------------------------------------

    def put_tensor(self, key: str, tensor: Any) -> int:
        return self._put_tensors([key], [tensor], None, upsert=False)[0]

    def upsert_tensor(self, key: str, tensor: Any) -> int:
        return self._put_tensors([key], [tensor], None, upsert=True)[0]

    def pub_tensor(self, key: str, tensor: Any, config: ReplicateConfig | None = None) -> int:
        return self._put_tensors([key], [tensor], config, upsert=False)[0]

    def upsert_pub_tensor(self, key: str, tensor: Any,
                          config: ReplicateConfig | None = None) -> int:
        return self._put_tensors([key], [tensor], config, upsert=True)[0]

    def batch_put_tensor(self, keys: Sequence[str], tensors_list: Sequence[Any]) -> list[int]:
        return self._put_tensors(keys, tensors_list, None, upsert=False)

    def batch_upsert_tensor(self, keys: Sequence[str], tensors_list: Sequence[Any]) -> list[int]:
        return self._put_tensors(keys, tensors_list, None, upsert=True)

    def batch_pub_tensor(self, keys: Sequence[str], tensors_list: Sequence[Any],
                         config: ReplicateConfig | None = None) -> list[int]:
        return self._put_tensors(keys, tensors_list, config, upsert=False)

    def batch_upsert_pub_tensor(self, keys: Sequence[str], tensors_list: Sequence[Any],
                                config: ReplicateConfig | None = None) -> list[int]:
        return self._put_tensors(keys, tensors_list, config, upsert=True)

    @needs_setup(per_key)
    def _put_tensors(self, keys: Sequence[str], tensors: Sequence[Any],
                     config: ReplicateConfig | None, upsert: bool) -> list[int]:
        if len(keys) != len(tensors):
            return [INVALID] * len(keys)
        return self._put_values(keys, [_encoded(t) for t in tensors], config, upsert)

    def get_tensor(self, key: str) -> Any | None:
        """The tensor stored under `key`, or None when missing or not a tensor."""
        return self.batch_get_tensor([key])[0]

    def batch_get_tensor(self, keys: Sequence[str]) -> list[Any | None]:
        if self._client is None:
            return [None] * len(keys)
        return [codec.decode(r.data) if r.ok else None
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
        return [_tensor_at(ptr, n) for ptr, n in zip(buffer_ptrs, read, strict=True)]

    # -- tensors already laid out in a registered buffer: [header][data] -------------------

    def put_tensor_from(self, key: str, buffer_ptr: int, size: int) -> int:
        return self._put_tensors_from([key], [buffer_ptr], [size], upsert=False)[0]

    def upsert_tensor_from(self, key: str, buffer_ptr: int, size: int) -> int:
        return self._put_tensors_from([key], [buffer_ptr], [size], upsert=True)[0]

    def batch_put_tensor_from(self, keys: Sequence[str], buffer_ptrs: Sequence[int],
                              sizes: Sequence[int]) -> list[int]:
        return self._put_tensors_from(keys, buffer_ptrs, sizes, upsert=False)

    def batch_upsert_tensor_from(self, keys: Sequence[str], buffer_ptrs: Sequence[int],
                                 sizes: Sequence[int]) -> list[int]:
        return self._put_tensors_from(keys, buffer_ptrs, sizes, upsert=True)

    @needs_setup(per_key)
    def _put_tensors_from(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int],
                          upsert: bool) -> list[int]:
        """Like `batch_put_from`, for buffers that each hold a whole tensor object; as in
        Mooncake, one bad item (unregistered, not a tensor) makes every item -600."""
        if not len(keys) == len(ptrs) == len(sizes) or not all(
                self._registered([(p, n)]) and _tensor_at(p, n) is not None
                for p, n in zip(ptrs, sizes, strict=True)):
            return [INVALID] * len(keys)
        return self._put_parts(keys, [[(p, n)] for p, n in zip(ptrs, sizes, strict=True)],
                               None, upsert)

    # -- tensor parallel ---------------------------------------------------------------------

    def put_tensor_with_tp(self, key: str, tensor: Any, tp_rank: int = 0, tp_size: int = 1,
                           split_dim: int = 0) -> int:
        return self._put_tp([key], [tensor], None, tp_size, split_dim)[0]

    def pub_tensor_with_tp(self, key: str, tensor: Any, config: ReplicateConfig | None = None,
                           tp_rank: int = 0, tp_size: int = 1, split_dim: int = 0) -> int:
        return self._put_tp([key], [tensor], config, tp_size, split_dim)[0]

    def batch_put_tensor_with_tp(self, base_keys: Sequence[str], tensors_list: Sequence[Any],
                                 tp_rank: int = 0, tp_size: int = 1,
                                 split_dim: int = 0) -> list[int]:
        return self._put_tp(base_keys, tensors_list, None, tp_size, split_dim)

    def batch_pub_tensor_with_tp(self, base_keys: Sequence[str], tensors_list: Sequence[Any],
                                 config: ReplicateConfig | None = None, tp_rank: int = 0,
                                 tp_size: int = 1, split_dim: int = 0) -> list[int]:
        return self._put_tp(base_keys, tensors_list, config, tp_size, split_dim)

    def put_tensor_with_tp_from(self, key: str, buffer_ptr: int, size: int, tp_rank: int = 0,
                                tp_size: int = 1, split_dim: int = 0) -> int:
        """Split the tensor laid out in the buffer ([header][data]) and store every shard."""
        if self._client is None or not self._registered([(buffer_ptr, size)]):
            return INVALID
        tensor = _tensor_at(buffer_ptr, size)
        if tensor is None:
            return INVALID
        return self._put_tp([key], [tensor], None, tp_size, split_dim)[0]

    def batch_put_tensor_with_tp_from(self, base_keys: Sequence[str], buffer_ptrs: Sequence[int],
                                      sizes: Sequence[int], tp_rank: int = 0, tp_size: int = 1,
                                      split_dim: int = 0) -> list[int]:
        if not len(base_keys) == len(buffer_ptrs) == len(sizes):
            return [INVALID] * len(base_keys)
        return [self.put_tensor_with_tp_from(k, p, n, tp_rank, tp_size, split_dim)
                for k, p, n in zip(base_keys, buffer_ptrs, sizes, strict=True)]

    @needs_setup(per_key)
    def _put_tp(self, keys: Sequence[str], tensors: Sequence[Any],
                config: ReplicateConfig | None, tp_size: int, split_dim: int) -> list[int]:
        """Per base key: 0 when every shard is stored, else the first failure."""
        if len(keys) != len(tensors):
            return [INVALID] * len(keys)
        out: list[int] = []
        for key, tensor in zip(keys, tensors, strict=True):
            objects = _tp_objects(key, tensor, tp_size, split_dim)
            if objects is None:
                out.append(INVALID)
                continue
            codes = self._put_values([k for k, _ in objects], [v for _, v in objects],
                                     config, upsert=False)
            out.append(next((c for c in codes if c), 0))
        return out

    def get_tensor_with_tp(self, key: str, tp_rank: int = 0, tp_size: int = 1,
                           split_dim: int = 0) -> Any | None:
        return self.get_tensor(_tp_key(key, tp_rank, tp_size))

    def batch_get_tensor_with_tp(self, base_keys: Sequence[str], tp_rank: int = 0,
                                 tp_size: int = 1) -> list[Any | None]:
        return self.batch_get_tensor([_tp_key(k, tp_rank, tp_size) for k in base_keys])

    def get_tensor_with_tp_into(self, key: str, buffer_ptr: int, size: int, tp_rank: int = 0,
                                tp_size: int = 1, split_dim: int = 0) -> Any | None:
        return self.get_tensor_into(_tp_key(key, tp_rank, tp_size), buffer_ptr, size)

    def batch_get_tensor_with_tp_into(self, base_keys: Sequence[str],
                                      buffer_ptrs: Sequence[int], sizes: Sequence[int],
                                      tp_rank: int = 0, tp_size: int = 1) -> list[Any | None]:
        return self.batch_get_tensor_into([_tp_key(k, tp_rank, tp_size) for k in base_keys],
                                          buffer_ptrs, sizes)


def _tp_key(key: str, tp_rank: int, tp_size: int) -> str:
    return key if tp_size == 1 else codec.shard_key(key, tp_rank)
