"""The store node the client tests share: 8 MiB of DRAM beside the test module's own
`master` fixture (each module sets its master's lease)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvpool.store.client.config import ClientConfig
from kvpool.store.client.store_client import StoreClient
from kvpool.store.master.server import MasterServer

MIB = 1 << 20


@pytest.fixture
def node(master: MasterServer) -> Iterator[StoreClient]:
    with StoreClient(ClientConfig(master=master.address, global_segment_size=8 * MIB,
                                  local_buffer_size=0, heartbeat_interval_s=0.2)) as n:
        yield n
