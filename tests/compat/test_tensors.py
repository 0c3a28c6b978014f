"""Tensor methods of the compat store and the header codec under them."""

from __future__ import annotations

import pytest
import torch

from kvpool.compat.mooncake import tensor_codec
from kvpool.compat.mooncake.store import MooncakeDistributedStore
from tests.compat.kv import kv_cache
from tests.support.require import missing, require_module

CASES = {
    "kv": kv_cache(2, seed=3),
    "bf16": torch.arange(24, dtype=torch.float32).reshape(2, 3, 4).to(torch.bfloat16),
    "scalar": torch.tensor(7, dtype=torch.int64),
    "empty": torch.zeros((0, 5), dtype=torch.float32),
    "bool": torch.tensor([True, False, True]),
    "strided": torch.arange(20, dtype=torch.int32).reshape(4, 5).t(),
}


def test_put_and_get_tensors(store: MooncakeDistributedStore) -> None:
    keys = [f"t-{name}" for name in CASES]
    assert store.batch_put_tensor(keys, list(CASES.values())) == [0] * len(CASES)
    for key, (name, tensor) in zip(keys, CASES.items(), strict=True):
        got = store.get_tensor(key)
        assert got is not None, name
        assert got.dtype == tensor.dtype and got.shape == tensor.shape
        assert torch.equal(got, tensor), name
    assert store.get_size("t-kv") == tensor_codec.HEADER_BYTES + CASES["kv"].numel() * 2
    assert store.get_tensor("missing") is None
    assert store.batch_get_tensor(["t-scalar", "missing"])[1] is None
    assert store.put("raw", b"not a tensor") == 0 and store.get_tensor("raw") is None
    assert store.put_tensor("t-kv", torch.zeros(1)) == 0  # immutable, like put
    assert torch.equal(store.get_tensor("t-kv"), CASES["kv"])
    assert store.upsert_tensor("t-kv", torch.ones(2)) == 0
    assert torch.equal(store.get_tensor("t-kv"), torch.ones(2))
    assert store.pub_tensor("t-pub", torch.ones(3)) == 0
    assert store.batch_pub_tensor(["t-pub2"], [torch.ones(1)]) == [0]
    assert store.batch_put_tensor(["a", "b"], [torch.ones(1)]) == [-600, -600]
    assert store.put_tensor("bad", "not a tensor") == -600


def test_get_tensor_into_views_the_registered_buffer(store: MooncakeDistributedStore) -> None:
    tensor = CASES["kv"]
    assert store.put_tensor("into", tensor) == 0
    size = tensor_codec.HEADER_BYTES + tensor.numel() * 2
    buf = torch.zeros(size + 64, dtype=torch.uint8)
    assert store.register_buffer(buf.data_ptr(), buf.numel()) == 0
    got = store.get_tensor_into("into", buf.data_ptr(), buf.numel())
    assert got is not None and torch.equal(got, tensor)
    assert got.data_ptr() == buf.data_ptr() + tensor_codec.HEADER_BYTES  # no copy
    assert store.get_tensor_into("into", buf.data_ptr(), 100) is None  # too small
    assert store.get_tensor_into("missing", buf.data_ptr(), buf.numel()) is None
    assert store.batch_get_tensor_into(["into"], [buf.data_ptr()], []) == [None]


def test_header_codec_rejects_what_it_did_not_write() -> None:
    head = tensor_codec.encode_header(CASES["bf16"])
    assert len(head) == tensor_codec.HEADER_BYTES
    got = tensor_codec.decode_header(head)
    assert got is not None and (got.dtype, got.shape) == (torch.bfloat16, (2, 3, 4))
    assert (got.data_offset, got.data_len) == (304, 48)
    assert tensor_codec.decode_header(head[:100]) is None
    assert tensor_codec.decode_header(b"XXXX" + head[4:]) is None
    assert tensor_codec.decode_header(head[:4] + b"\x09\x00" + head[6:]) is None  # version
    for cut in range(tensor_codec.HEADER_BYTES + 48):
        assert tensor_codec.decode(tensor_codec.encode(CASES["bf16"])[:cut]) is None
    assert tensor_codec.decode(tensor_codec.encode(CASES["bf16"]) + b"\x00") is None
    with pytest.raises(ValueError):
        tensor_codec.encode_header(torch.zeros([1] * 9))
    with pytest.raises(ValueError):
        tensor_codec.encode_header(torch.zeros(1, dtype=torch.complex64))  # as in Mooncake


MOONCAKE_DTYPES = [torch.float32, torch.float64, torch.int8, torch.uint8, torch.int16,
                   torch.uint16, torch.int32, torch.uint32, torch.int64, torch.uint64,
                   torch.bool, torch.float16, torch.bfloat16, torch.float8_e4m3fn,
                   torch.float8_e5m2]


def test_layout_is_mooncakes() -> None:
    """Byte for byte what the real wheel's serializer writes (skipped without the wheel)."""
    real = require_module("mooncake.store", "the real Mooncake wheel (scripts/setup.sh)")
    if not hasattr(real, "_serialize_tensor"):
        missing("this mooncake wheel has no _serialize_tensor")
    import ctypes

    for tensor in [*CASES.values(), *(torch.zeros(3, 2, dtype=d) for d in MOONCAKE_DTYPES)]:
        meta, ptr, size, _owner = real._serialize_tensor(tensor)
        ours = tensor_codec.encode(tensor)
        assert ours == meta + ctypes.string_at(ptr, size), tensor.dtype
        back = tensor_codec.decode(bytearray(ours))
        assert back is not None and torch.equal(back, tensor.contiguous())


def test_shard_header_fields() -> None:
    tensor = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    shards = tensor_codec.split(tensor, 3, 1)
    assert shards is not None and [s.extent for _, s in shards] == [2, 2, 2]
    part, shard = shards[2]
    head = tensor_codec.encode_header(part, (4, 6), shard)
    import struct

    assert struct.unpack_from("<I", head, 16)[0] == 1  # sharded
    assert struct.unpack_from("<8q", head, 40)[:3] == (4, 6, -1)  # full shape
    assert struct.unpack_from("<8q", head, 104)[:3] == (4, 2, -1)  # shard shape
    assert struct.unpack_from("<QQIIIxxxxQ", head, 168) == (1, 1, 2, 3, 1, 2)
    assert tensor_codec.split(tensor, 4, 1) is None and tensor_codec.split(tensor, 2, 2) is None


def test_tensor_parallel_variants(store: MooncakeDistributedStore) -> None:
    full = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    assert store.put_tensor_with_tp("w", full, 0, 2, 0) == 0
    assert [store.is_exist(k) for k in ("w", "w_tp_0", "w_tp_1")] == [0, 1, 1]
    assert torch.equal(store.get_tensor_with_tp("w", 1, 2), full[2:])
    assert torch.equal(store.get_tensor("w_tp_0"), full[:2])
    assert store.put_tensor_with_tp("w", full * 2, 0, 2, 0) == 0  # immutable
    assert torch.equal(store.get_tensor_with_tp("w", 0, 2), full[:2])
    assert store.put_tensor_with_tp("odd", full, 0, 4, 1) == -600
    assert store.put_tensor_with_tp("one", full, 0, 1, 0) == 0
    assert torch.equal(store.get_tensor_with_tp("one", 0, 1), full)
    assert store.batch_put_tensor_with_tp(["c1", "c2"], [full, full + 1], 0, 3, 1) == [0, 0]
    got = store.batch_get_tensor_with_tp(["c1", "c2", "none"], 2, 3)
    assert torch.equal(got[0], full[:, 4:]) and torch.equal(got[1], full[:, 4:] + 1)
    assert got[2] is None
    assert store.pub_tensor_with_tp("p", full, None, 0, 2, 1) == 0
    assert store.batch_pub_tensor_with_tp(["p2"], [full], None, 0, 2, 0) == [0]
    buf = torch.zeros(4096, dtype=torch.uint8)
    assert store.register_buffer(buf.data_ptr(), buf.numel()) == 0
    into = store.get_tensor_with_tp_into("w", buf.data_ptr(), 2048, 1, 2)
    assert torch.equal(into, full[2:])
    into = store.batch_get_tensor_with_tp_into(["p", "none"], [buf.data_ptr(),
                                                buf.data_ptr() + 2048], [2048, 2048], 1, 2)
    assert torch.equal(into[0], full[:, 3:]) and into[1] is None


def test_tensor_from_buffers(store: MooncakeDistributedStore) -> None:
    full = torch.arange(8, dtype=torch.int16).reshape(2, 4)
    raw = tensor_codec.encode(full)
    buf = torch.zeros(1024, dtype=torch.uint8)
    buf[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    ptr = buf.data_ptr()
    assert store.put_tensor_from("f", ptr, len(raw)) == -600  # not registered yet
    assert store.register_buffer(ptr, buf.numel()) == 0
    assert store.put_tensor_from("f", ptr, len(raw)) == 0
    assert torch.equal(store.get_tensor("f"), full)
    assert store.put_tensor_from("g", ptr, 100) == -600  # not a whole tensor object
    assert store.batch_put_tensor_from(["g", "h"], [ptr, ptr + 1], [len(raw)] * 2) == [-600] * 2
    assert store.batch_put_tensor_from(["g", "h"], [ptr, ptr], [len(raw)] * 2) == [0, 0]
    assert store.upsert_tensor_from("f", ptr, len(raw)) == 0
    assert store.batch_upsert_tensor_from(["f"], [ptr], [len(raw)]) == [0]
    assert store.put_tensor_with_tp_from("s", ptr, len(raw), 0, 2, 1) == 0
    assert torch.equal(store.get_tensor_with_tp("s", 1, 2), full[:, 2:])
    assert store.batch_put_tensor_with_tp_from(["s2"], [ptr], [len(raw)], 0, 2, 0) == [0]
    assert store.upsert_pub_tensor("f", full * 3) == 0
    assert store.batch_upsert_pub_tensor(["f"], [full * 4]) == [0]
    assert torch.equal(store.get_tensor("f"), full * 4)
