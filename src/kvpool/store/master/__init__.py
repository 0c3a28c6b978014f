"""The master: metadata only (objects, replicas, segments, leases, eviction, liveness).

`core` is the sans-I/O state machine on an injected clock (with `state`, `batch`, `evict`,
`check`, and the `placement`/`eviction` policies); `service` turns request frames into reply
frames; `rpc_server` drives it over TCP; `server` is the process (RPC + admin HTTP +
embedded metadata); `persist`/`records` keep a state directory; `election`/`ha` run several
masters behind an etcd lease.
"""

from typing import Any

__all__ = ["MasterServer", "MasterServerConfig", "tune_gc_for_master"]


def __getattr__(name: str) -> Any:
    # The server pulls in FastAPI and uvicorn: import on use.
    if name in __all__:
        from kvpool.store.master import server
        return getattr(server, name)
    raise AttributeError(f"module 'kvpool.store.master' has no attribute {name!r}")
