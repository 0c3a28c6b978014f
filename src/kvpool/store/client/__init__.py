"""The store client: the library inside engine processes (and the store-node daemon).

`store_client.StoreClient` is the API; `base` holds the machinery (transfer engine, master
RPC, mounts, heartbeats, the two data paths); `plan`, `batches` and `checksum` are pure
helpers; `rpc` is the blocking master connection; `aio` the asyncio face. It imports the
wire package, never master code.
"""

from typing import Any

from kvpool.store.client.config import ClientConfig

__all__ = ["AsyncStoreClient", "ClientConfig", "StoreClient"]


def __getattr__(name: str) -> Any:
    # The client pulls in the transfer engine: import on use.
    if name == "StoreClient":
        from kvpool.store.client.store_client import StoreClient
        return StoreClient
    if name == "AsyncStoreClient":
        from kvpool.store.client.aio import AsyncStoreClient
        return AsyncStoreClient
    raise AttributeError(f"module 'kvpool.store.client' has no attribute {name!r}")
