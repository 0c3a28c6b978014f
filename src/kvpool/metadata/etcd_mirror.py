"""A MemoryBackend whose every change is first written to etcd, and which starts from what
etcd holds: the metadata server's `--etcd` backing.

Reads are served from memory; a PUT or DELETE reaches etcd (under `prefix` + key) before it
changes memory or is acknowledged, so a server restarted anywhere with the same etcd and
prefix serves every acknowledged key. When etcd cannot be reached the change is refused
(MetadataError: the HTTP server answers 503) and memory is unchanged. Keys changed in etcd by
someone else while the server runs are not seen until it restarts: one server owns a prefix.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvpool.log import get_logger
from kvpool.metadata.etcd_backend import EtcdMetadataBackend
from kvpool.metadata.memory import MemoryBackend

DEFAULT_PREFIX = "/kvpool/metadata/"
_log = get_logger("metadata.etcd_mirror")


class EtcdMirroredBackend(MemoryBackend):
    writes_block = True

    def __init__(self, endpoints: Sequence[tuple[str, int]],
                 prefix: str = DEFAULT_PREFIX) -> None:
        super().__init__()
        self.etcd = EtcdMetadataBackend(endpoints)
        self.prefix = prefix
        self._items = self.etcd.items_with_prefix(prefix)
        self._total_bytes = sum(len(v) for v in self._items.values())
        _log.info("metadata from %s%s: %d keys restored", self.etcd.url, prefix,
                  len(self._items))

    def _journal_put(self, key: str, value: bytes) -> None:
        self.etcd.put(self.prefix + key, value)

    def _journal_delete(self, key: str) -> None:
        self.etcd.delete(self.prefix + key)

    def _release(self) -> None:
        self.etcd.close()
