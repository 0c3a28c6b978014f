"""The master's tables: segments, stored objects, pending puts and clients (plain data)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from kvpool.store.allocator import OffsetAllocator
from kvpool.store.wire.codes import ReplicaDesc, ReplicaState, SegmentInfo, Tier


@dataclass(eq=False)
class Segment:
    """Memory one client contributes: [base_addr, base_addr + capacity) in its process."""

    segment_id: str
    client_id: str
    endpoint: str
    base_addr: int
    allocator: OffsetAllocator
    tier: Tier = Tier.DRAM
    fence: int = 0
    """The owner's write fence for this mount (a fresh random value per mount)."""
    keys: set[str] = field(default_factory=set)
    """Keys of complete objects with a replica here."""
    pending_keys: set[str] = field(default_factory=set)
    draining: bool = False
    """Being drained (drain.py): placement skips it; its objects move elsewhere."""

    @property
    def capacity(self) -> int:
        return self.allocator.capacity

    def info(self) -> SegmentInfo:
        return SegmentInfo(self.segment_id, self.client_id, self.endpoint, self.base_addr,
                           self.capacity, self.allocator.used_bytes, self.tier,
                           self.draining)


class Replica(NamedTuple):
    """One allocated copy of an object (immutable; a tuple because puts make many)."""

    segment: Segment
    offset: int
    size: int

    def desc(self, state: ReplicaState = ReplicaState.COMPLETE) -> ReplicaDesc:
        seg = self.segment
        return ReplicaDesc(seg.segment_id, seg.endpoint, seg.base_addr + self.offset,
                           self.size, seg.tier, state, seg.fence)


@dataclass(eq=False, slots=True)
class StoredObject:
    key: str
    size: int
    replicas: list[Replica]
    lease_until: float = 0.0
    hard_pinned: bool = False
    soft_pin_until: float = 0.0
    checksum: int | None = None
    """xxh3_64 of the bytes, sent by the writer with put_end (None: no checksum)."""


class PendingPut(NamedTuple):
    """A put between start and end/revoke (immutable)."""

    key: str
    size: int
    replicas: list[Replica]
    client_id: str
    started: float
    upsert: bool
    hard_pinned: bool
    soft_pinned: bool


@dataclass(eq=False, slots=True)
class ClientState:
    client_id: str
    last_seen: float
    segment_ids: set[str] = field(default_factory=set)
