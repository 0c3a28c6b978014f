"""Finding peers: segment name -> descriptor, through the directory or a P2P handshake."""

from __future__ import annotations

import threading

from kvpool.clock import SYSTEM_CLOCK, Clock
from kvpool.errors import KvpoolError, SegmentNotFound
from kvpool.metadata import MetadataBackend
from kvpool.transfer.config import TransferConfig
from kvpool.transfer.segment import SegmentDescriptor, parse_segment_name, segment_key
from kvpool.transfer.tcp_client import open_connection

_REFRESH_MIN_S = 0.2


class PeerDirectory:
    """Caches descriptors of peer segments; refreshes one on demand (rate-limited)."""

    def __init__(self, backend: MetadataBackend | None, config: TransferConfig, me: str,
                 clock: Clock = SYSTEM_CLOCK) -> None:
        self._clock = clock
        self._backend = backend
        self._config = config
        self._me = me
        self._cache: dict[str, SegmentDescriptor] = {}
        self._fetched_at: dict[str, float] = {}
        self._lock = threading.Lock()

    def lookup(self, name: str) -> SegmentDescriptor:
        """The descriptor of `name`; raises SegmentNotFound / PeerUnavailable / MetadataError."""
        found = self._cache.get(name)
        if found is not None:
            return found
        return self._fetch(name)

    def cached(self, name: str) -> SegmentDescriptor | None:
        """The descriptor of `name` if one is cached; never asks anyone."""
        return self._cache.get(name)

    def refresh(self, name: str) -> SegmentDescriptor | None:
        """Fetch again if the cached copy is old enough; None when rate-limited."""
        if self._clock.now() - self._fetched_at.get(name, 0.0) < _REFRESH_MIN_S:
            return None
        try:
            return self._fetch(name)
        except KvpoolError:
            return None

    def _fetch(self, name: str) -> SegmentDescriptor:
        if self._backend is None:
            descriptor = self._handshake(name)
        else:
            raw = self._backend.get(segment_key(name))
            if raw is None:
                raise SegmentNotFound(f"segment {name!r} is not in the metadata directory")
            descriptor = SegmentDescriptor.from_json(raw)
        _check_names(descriptor, name)
        with self._lock:
            self._cache[name] = descriptor
            self._fetched_at[name] = self._clock.now()
        return descriptor

    def _handshake(self, name: str) -> SegmentDescriptor:
        host, port = parse_segment_name(name)
        sock, body = open_connection(host, port, self._config, self._me)
        sock.close()
        return SegmentDescriptor.from_dict(body)


def _check_names(descriptor: SegmentDescriptor, name: str) -> None:
    """The descriptor fetched for segment `name` describes that segment, at that address:
    a peer (or a directory entry) that answers with another's would send our transfers
    elsewhere, reported OK."""
    if descriptor.name != name or \
            (descriptor.host.strip("[]"), descriptor.port) != parse_segment_name(name):
        raise SegmentNotFound(f"the descriptor found for segment {name!r} describes "
                              f"{descriptor.name!r} at {descriptor.host}:{descriptor.port}")
