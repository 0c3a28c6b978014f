"""The metadata service: a small key/value directory of segment descriptors.

Backends share one contract (`MetadataBackend`): `get`, `put`, `delete`, `close`, with opaque
bytes values and caller-chosen keys stored verbatim. `connect_metadata(uri)` picks one from a
URI; `MetadataServer` / `create_metadata_app` serve the HTTP protocol.
"""

from typing import TYPE_CHECKING

from kvpool.metadata.base import MetadataBackend, MetadataClientConfig
from kvpool.metadata.memory import MemoryBackend
from kvpool.metadata.uri import P2P_HANDSHAKE, connect_metadata

if TYPE_CHECKING:
    from kvpool.metadata.server import MetadataLimits, MetadataServer, create_metadata_app

__all__ = [
    "P2P_HANDSHAKE",
    "MemoryBackend",
    "MetadataBackend",
    "MetadataClientConfig",
    "MetadataLimits",
    "MetadataServer",
    "connect_metadata",
    "create_metadata_app",
]


def __getattr__(name: str) -> object:
    # The server pulls in FastAPI and uvicorn; import it only when asked for.
    if name in ("MetadataLimits", "MetadataServer", "create_metadata_app"):
        from kvpool.metadata import server

        return getattr(server, name)
    raise AttributeError(f"module 'kvpool.metadata' has no attribute {name!r}")
