"""Fixtures for the Mooncake-compatible API: a real `kvpool master` started with Mooncake's
flag spellings, and compat stores set up against it."""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest

from kvpool.compat.mooncake.store import MooncakeDistributedStore
from tests.support.net import free_port, wait_port
from tests.support.procs import running, spawn_kvpool

LEASE_MS = 1000
"""Read lease of the test master: long enough to observe, short enough to wait out."""
MIB = 1 << 20


@dataclass(frozen=True)
class Master:
    rpc_port: int
    metadata_port: int
    proc: subprocess.Popen[bytes]

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def http_metadata(self) -> str:
        return f"http://127.0.0.1:{self.metadata_port}/metadata"


def start_master(*extra: str) -> tuple[int, int, subprocess.Popen[bytes]]:
    """`kvpool master` as a Mooncake deployment script starts `mooncake_master`."""
    rpc, metrics, meta = free_port(), free_port(), free_port()
    proc = spawn_kvpool("master", "--rpc_port", str(rpc), "--metrics_port", str(metrics),
                        "--enable_http_metadata_server", "true",
                        "--http_metadata_server_port", str(meta),
                        "--default_kv_lease_ttl", str(LEASE_MS), *extra)
    wait_port(rpc), wait_port(meta)
    return rpc, meta, proc


@pytest.fixture(scope="module")
def master() -> Iterator[Master]:
    rpc, meta, proc = start_master()
    with running(proc):
        yield Master(rpc, meta, proc)


StoreFactory = Callable[..., MooncakeDistributedStore]


@pytest.fixture
def make_store(master: Master) -> Iterator[StoreFactory]:
    """Set up compat stores (32 MiB segment each unless told); all are emptied and closed."""
    stores: list[MooncakeDistributedStore] = []

    def make(segment: int = 32 * MIB, buffer: int = 16 * MIB,
             metadata: str = "P2PHANDSHAKE") -> MooncakeDistributedStore:
        store = MooncakeDistributedStore()
        rc = store.setup("127.0.0.1", metadata, segment, buffer, "tcp", "", master.address)
        assert rc == 0
        stores.append(store)
        return store

    yield make
    if stores:
        stores[0].remove_all(True)
    for store in stores:
        assert store.close() == 0


@pytest.fixture
def store(make_store: StoreFactory) -> MooncakeDistributedStore:
    return make_store()
