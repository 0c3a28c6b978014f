"""What the master core's collaborators may use of it: the tables, the clock and config, and
a few actions. Drain, eviction, tiering, reservations, the batched put path, the integrity
check and the journal are typed against these protocols, never against MasterCore, so none
of them imports core.py (which imports them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from kvpool.clock import Clock
    from kvpool.store.config import MasterConfig, ReplicateConfig
    from kvpool.store.master.eviction import EvictionPolicy
    from kvpool.store.master.pending import PendingPuts
    from kvpool.store.master.placement import PlacementPolicy
    from kvpool.store.master.replay import JournalStats
    from kvpool.store.master.space import FreeSpace
    from kvpool.store.master.state import ClientState, Replica, Segment, StoredObject
    from kvpool.store.master.tables import ObjectTable, SegmentTable
    from kvpool.store.wire.codes import ErrorCode, PutStartResult, Tier


class DiskTier(Protocol):
    """The disk tier (tiering.Tiering), as the drain uses it."""

    def drop_disk_replica(self, obj: StoredObject, rep: Replica) -> None:
        """Take a disk replica out (its file deleted; the object plain DRAM again, or
        removed where it was its only replica)."""


class JournalHooks(Protocol):
    """Persistence (persist.Journal): told of every durable change, and of each tick."""

    def on_mount(self, core: CoreApi, seg: Segment) -> None: ...

    def on_drop(self, segment_id: str) -> None: ...

    def on_put(self, obj: StoredObject) -> None:
        """A stored object changed (replicas, tier)."""

    def on_publish(self, obj: StoredObject) -> None:
        """A put made `obj` visible; the journal calls `unpublish(obj)` if its record
        cannot be written."""

    def on_remove(self, key: str) -> None: ...

    def remove_recovering(self, key: str) -> bool: ...

    def on_tick(self, core: CoreApi) -> None: ...

    def stats(self) -> JournalStats: ...


class CoreApi(Protocol):
    config: MasterConfig
    clock: Clock
    policy: EvictionPolicy
    placement: PlacementPolicy
    objects: ObjectTable
    segments: SegmentTable
    pending: PendingPuts
    space: FreeSpace
    clients: dict[str, ClientState]
    journal: JournalHooks | None

    @property
    def tiering(self) -> DiskTier: ...

    @property
    def capacity_bytes(self) -> int: ...

    @property
    def used_bytes(self) -> int: ...

    def segment_list(self) -> list[Segment]: ...

    def touch_client(self, client_id: str) -> ClientState: ...

    def mount_segment(self, client_id: str, endpoint: str, base_addr: int, size: int,
                      tier: Tier = ..., fence: int = 0) -> tuple[ErrorCode, str]: ...

    def allocate(self, size: int, count: int, preferred: list[str],
                 now: float) -> list[Replica] | None: ...

    def put_start_one(self, client_id: str, key: str, size: int, config: ReplicateConfig,
                      upsert: bool, preferred: list[str], now: float,
                      reserved: bool = False) -> PutStartResult: ...

    def put_end_one(self, client_id: str, key: str, checksum: int | None) -> ErrorCode: ...

    def remove_object(self, obj: StoredObject, defer: bool) -> None: ...

    def unpublish(self, obj: StoredObject, hold: bool = False) -> None: ...


