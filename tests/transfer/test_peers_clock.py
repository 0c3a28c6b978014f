"""The peer directory refreshes a cached descriptor at most every 0.2 s, on its clock."""

from __future__ import annotations

from dataclasses import replace

from kvpool.clock import VirtualClock
from kvpool.metadata.memory import MemoryBackend
from kvpool.transfer.config import TransferConfig
from kvpool.transfer.peers import PeerDirectory
from kvpool.transfer.segment import SegmentDescriptor, segment_key


def test_a_refresh_is_rate_limited_on_the_directory_clock() -> None:
    backend, clock = MemoryBackend(), VirtualClock(100.0)
    first = SegmentDescriptor("10.0.0.2:7000", "10.0.0.2", 7000, "host-b", 41)
    backend.put(segment_key(first.name), first.to_json())
    peers = PeerDirectory(backend, TransferConfig(), "10.0.0.1:7000", clock)
    assert peers.lookup(first.name) == first
    restarted = replace(first, pid=42)
    backend.put(segment_key(first.name), restarted.to_json())
    clock.advance(0.19)
    assert peers.refresh(first.name) is None and peers.cached(first.name) == first
    clock.advance(0.01)
    assert peers.refresh(first.name) == restarted and peers.lookup(first.name) == restarted
