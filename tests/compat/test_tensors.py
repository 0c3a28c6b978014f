"""Tensor methods of the compat store and the header codec under them."""

from __future__ import annotations

import pytest
import torch

from kvpool.compat.mooncake import tensor_codec
from kvpool.compat.mooncake.store import MooncakeDistributedStore
from tests.compat.kv import kv_cache

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
    assert tensor_codec.decode_header(head) == (torch.bfloat16, (2, 3, 4))
    assert tensor_codec.decode_header(head[:-1]) is None
    assert tensor_codec.decode_header(b"XXXX" + head[4:]) is None
    assert tensor_codec.decode_header(head[:4] + b"\x09\x00" + head[6:]) is None  # version
    for cut in range(tensor_codec.HEADER_BYTES):
        assert tensor_codec.decode(head[:cut]) is None
    assert tensor_codec.decode(head + b"\x00") is None  # data size disagrees with shape
    with pytest.raises(ValueError):
        tensor_codec.encode_header(torch.zeros([1] * 9))
    with pytest.raises(ValueError):
        tensor_codec.encode_header(torch.zeros(1, dtype=torch.float8_e4m3fn))
