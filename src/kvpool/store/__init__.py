"""kvpool.store: the KVCache pool (Mooncake Store).

A master (`kvpool master`, MasterServer) keeps metadata only; clients (StoreClient, or
AsyncStoreClient for asyncio) put and get object bytes directly between processes with the
transfer engine; `kvpool store-node` contributes DRAM. See docs/store.md.
"""

from kvpool.store.client.config import ClientConfig
from kvpool.store.config import MasterConfig, ReplicateConfig
from kvpool.store.wire.codes import (
    ErrorCode,
    GetResult,
    LookupResult,
    PutResult,
    ReadResult,
    ReplicaDesc,
    ReplicaState,
    Tier,
)

__all__ = [
    "AsyncStoreClient",
    "ClientConfig",
    "ErrorCode",
    "GetResult",
    "LookupResult",
    "MasterConfig",
    "MasterServer",
    "MasterServerConfig",
    "PutResult",
    "ReadResult",
    "ReplicaDesc",
    "ReplicaState",
    "ReplicateConfig",
    "StoreClient",
    "Tier",
]


def __getattr__(name: str) -> object:
    # Clients pull in the transfer engine and the master pulls in FastAPI: import on use.
    if name == "StoreClient":
        from kvpool.store.client.store_client import StoreClient
        return StoreClient
    if name == "AsyncStoreClient":
        from kvpool.store.client.aio import AsyncStoreClient
        return AsyncStoreClient
    if name in ("MasterServer", "MasterServerConfig"):
        from kvpool.store import master
        return getattr(master, name)
    raise AttributeError(f"module 'kvpool.store' has no attribute {name!r}")
