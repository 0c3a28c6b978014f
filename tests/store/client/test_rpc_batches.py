"""Batches larger than one master request: the client splits them, and a request the master
refuses as a whole reaches users with the master's code, not RPC_FAIL."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvpool.errors import RpcError
from kvpool.store.client.batches import RPC_BATCH_KEY_BYTES, key_chunks, refusal_code
from kvpool.store.client.config import ClientConfig
from kvpool.store.client.rpc import RpcClient
from kvpool.store.client.store_client import StoreClient
from kvpool.store.config import MasterConfig
from kvpool.store.master.server import MasterServer, MasterServerConfig
from kvpool.store.wire.codes import ErrorCode as E
from kvpool.store.wire.messages import ExistsMsg, PingMsg

MIB = 1 << 20


@pytest.fixture
def master() -> Iterator[MasterServer]:
    config = MasterServerConfig(rpc_port=0, admin_port=0, enable_http_metadata=False,
                                tick_interval_s=0.05, token=None)
    with MasterServer(config, MasterConfig(max_batch=4)) as m:
        yield m


def _client(master: MasterServer, **cfg: object) -> StoreClient:
    return StoreClient(ClientConfig(master=master.address, local_buffer_size=MIB,
                                    token=None, **cfg))  # type: ignore[arg-type]


def test_key_chunks_cut_by_count_and_by_bytes() -> None:
    assert key_chunks([], 4) == []
    assert key_chunks(["a"] * 9, 4) == [(0, 4), (4, 8), (8, 9)]
    big = "k" * (4 << 10)
    per_chunk = RPC_BATCH_KEY_BYTES // (len(big) + 64)
    chunks = key_chunks([big] * (per_chunk + 1), 1 << 20)
    assert chunks == [(0, per_chunk), (per_chunk, per_chunk + 1)]
    assert key_chunks([big] * per_chunk, 1 << 20) == [(0, per_chunk)]  # just fits
    wide = "\u00e9" * (2 << 10)  # 2 UTF-8 bytes per character
    per_wide = RPC_BATCH_KEY_BYTES // (2 * len(wide) + 64)
    assert key_chunks([wide] * (per_wide + 1), 1 << 20) == [(0, per_wide),
                                                           (per_wide, per_wide + 1)]


def test_refusal_codes() -> None:
    assert [refusal_code(s) for s in (None, 0, -600, -1, 12345)] == [
        E.RPC_FAIL, E.RPC_FAIL, E.INVALID_PARAMS, E.INTERNAL_ERROR, E.RPC_FAIL]


def test_a_whole_request_refusal_carries_the_masters_code(master: MasterServer) -> None:
    with RpcClient(master.address, "w") as rpc:
        with pytest.raises(RpcError, match="exceeds 4") as info:
            rpc.call(ExistsMsg(keys=["a", "b", "c", "d", "e"]))
        assert info.value.status == E.INVALID_PARAMS
        assert rpc.call(PingMsg()) == "pong"


def test_a_batch_over_max_batch_is_invalid_params_per_key(master: MasterServer) -> None:
    with _client(master, rpc_batch_keys=8) as client:
        assert client.batch_exists([f"k{i}" for i in range(6)]) == [E.INVALID_PARAMS] * 6
        assert client.batch_remove([f"k{i}" for i in range(6)]) == [E.INVALID_PARAMS] * 6


def test_large_batches_are_split_transparently(master: MasterServer) -> None:
    with StoreClient(ClientConfig(master=master.address, global_segment_size=8 * MIB,
                                  local_buffer_size=0, token=None, rpc_batch_keys=4)), \
            _client(master, rpc_batch_keys=4) as client:
        keys = [f"k{i}" for i in range(11)]
        values = [bytes([i]) * 100 for i in range(11)]
        assert all(r.ok for r in client.put_batch(keys, values))
        assert client.batch_exists(keys + ["nope"]) == [E.OK] * 11 + [E.OBJECT_NOT_FOUND]
        assert [r.data for r in client.get_batch(keys)] == values
        assert client.batch_remove(keys, force=True) == [E.OK] * 11


def test_a_request_too_large_for_a_frame_is_not_sent(master: MasterServer) -> None:
    with RpcClient(master.address, "w") as rpc:
        with pytest.raises(RpcError, match="not sent") as info:
            rpc.call(ExistsMsg(keys=["k" * 4096] * (17 << 10)))
        assert info.value.status == E.INVALID_PARAMS
        assert rpc.call(PingMsg()) == "pong"


@pytest.mark.slow  # 10 s
def test_keys_beyond_a_frame_are_split_by_bytes() -> None:
    config = MasterServerConfig(rpc_port=0, admin_port=0, enable_http_metadata=False,
                                tick_interval_s=0.05, token=None)
    with MasterServer(config, MasterConfig()) as m, _client(m, rpc_batch_keys=1 << 20) as client:
        keys = [f"{i:06d}" + "k" * 4000 for i in range(17_000)]  # 68 MiB of keys
        assert client.batch_exists(keys) == [E.OBJECT_NOT_FOUND] * len(keys)
