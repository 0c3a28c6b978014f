"""Zero-copy calls on memory the engine does not know are INVALID_PARAMS per item, the same on
every route (own segment, peer), and start no put."""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np
import pytest

from kvpool.store.client.config import ClientConfig
from kvpool.store.client.store_client import StoreClient
from kvpool.store.config import MasterConfig
from kvpool.store.master.server import MasterServer, MasterServerConfig
from kvpool.store.wire.codes import ErrorCode as E

MIB = 1 << 20
SIZE = 8192


@pytest.fixture
def pair() -> Iterator[tuple[StoreClient, StoreClient]]:
    config = MasterServerConfig(rpc_port=0, admin_port=0, enable_http_metadata=False,
                                token=None)
    with MasterServer(config, MasterConfig()) as m, \
            StoreClient(ClientConfig(master=m.address, global_segment_size=4 * MIB,
                                     local_buffer_size=MIB, token=None)) as node, \
            StoreClient(ClientConfig(master=m.address, local_buffer_size=MIB,
                                     token=None)) as pure:
        yield node, pure


@pytest.mark.parametrize("who", ["node", "pure"])
def test_unregistered_memory_is_invalid_params_on_every_route(
        pair: tuple[StoreClient, StoreClient], who: str) -> None:
    node, pure = pair
    client = node if who == "node" else pure
    value = os.urandom(SIZE)
    assert node.put("k", value).ok
    assert node.replica_desc("k").replicas[0].endpoint == node.endpoint
    unregistered = np.zeros(SIZE, np.uint8)
    ok = client.engine.register(np.zeros(SIZE, np.uint8))
    read_only = client.engine.register(bytes(SIZE))
    for addr in (unregistered.ctypes.data, read_only.addr, 1 << 64, (1 << 64) - 4096):
        assert client.get_into("k", addr, SIZE).code == E.INVALID_PARAMS
    assert [r.code for r in client.batch_get_into(
        ["k", "k"], [unregistered.ctypes.data, ok.addr], [SIZE, SIZE])] == [E.INVALID_PARAMS, E.OK]
    assert bytes(ok.view) == value
    assert client.put_from("u", unregistered.ctypes.data, SIZE).code == E.INVALID_PARAMS
    assert client.put_from("u", 1 << 64, SIZE).code == E.INVALID_PARAMS
    again = pure.put("u", b"x" * 100)                # no put of "u" was started
    assert again.ok and not again.already_existed
