"""The master's side of the disk (SSD) tier: what leaves DRAM for disk, what comes back.

Sans-I/O like the core it hooks into. A node with a disk tier mounts it as a segment of tier
SSD (`attach`); that segment's allocator is the master's account of the disk. Then:

- **Offload.** An eviction victim whose DRAM replica lives on a node with a disk tier is not
  dropped: the master reserves disk space and queues OFFLOAD; the object stays readable from
  DRAM meanwhile. On the node's report the object gets its SSD replica and its DRAM ranges
  are freed (after the read lease, if leased). Puts never wait for it: bytes in flight count
  toward the eviction target, and an allocation that finds nothing free right now fails.
  An object already on disk loses its DRAM copy at once (no copy needed); so that this is
  the common case, the coldest `clean_share` of DRAM is copied ahead of eviction
  (tier_offload.py).
- **Load.** A lookup of a disk-only object answers REPLICA_IS_NOT_READY while a DRAM range is
  reserved (placement as for a put, the disk's own node first) and LOAD is queued; the
  client looks again shortly. The loaded copy is transient (freed when the read lease ends)
  until the object has been read `promote_after` times since it went to disk: then it is a
  normal DRAM replica again (promotion), evictable by the DRAM policy.
- **Disk eviction.** Above `disk_high_watermark` of a disk's capacity (or when an offload
  finds no room), the least recently used disk replicas of unleased objects are dropped;
  an object whose only replica that was is removed. Every dropped disk replica queues DELETE.
- **Restart.** A node scans its files and registers them (`register`): new keys become
  disk-only objects, existing objects with the same size and checksum gain the replica,
  anything else is refused (the node deletes the file).
"""


from __future__ import annotations

from collections.abc import Sequence

from kvpool.store.master import tier_offload, tier_reads
from kvpool.store.master.state import StoredObject
from kvpool.store.master.tier_state import TierState
from kvpool.store.master.tier_tasks import DONE, LOAD, OFFLOAD
from kvpool.store.wire.codes import ErrorCode, LookupResult

E = ErrorCode


class Tiering(TierState):
    """The disk tier of one master core: TierState plus the requests of nodes and the
    core's hooks that run offloads (tier_offload.py) and reads (tier_reads.py)."""

    # -- nodes -----------------------------------------------------------------------------

    def report(self, client_id: str, segment_id: str,
               outcomes: Sequence[tuple[int, int]]) -> ErrorCode:
        """Outcomes of tasks: (task_id, DONE | FAILED | FILE_BAD); unknown ids (reported
        twice, or cancelled) are ignored."""
        mount = self.mount_of(client_id, segment_id)
        if mount is None:
            return E.SEGMENT_NOT_FOUND
        for task_id, status in outcomes:
            task = mount.take(task_id)
            if task is not None and task.kind == OFFLOAD:
                tier_offload.offload_done(self, task, status == DONE)
            elif task is not None and task.kind == LOAD:
                tier_reads.load_done(self, task, status)
        if outcomes:
            self.clean_if_wanted()
        return E.OK

    # -- offload (tier_offload.py) ----------------------------------------------------------

    def take_victims(self, victims: list[StoredObject]) -> tuple[list[StoredObject], int]:
        """See tier_offload.take_victims."""
        return tier_offload.take_victims(self, victims)

    def clean_if_wanted(self) -> None:
        """After an eviction round or a report: when eviction took from the clean share (or
        the last walk stopped at its cap), copy the next objects ahead (rate-limited)."""
        under_way = self.under_way
        if under_way.clean_wanted and self.core.clock.now() >= under_way.clean_due:
            tier_offload.clean_ahead(self)

    # -- reads (tier_reads.py) --------------------------------------------------------------

    def on_lookup(self, obj: StoredObject) -> LookupResult | None:
        """See tier_reads.on_lookup."""
        return tier_reads.on_lookup(self, obj)

    def register(self, client_id: str, segment_id: str, keys: Sequence[str],
                 sizes: Sequence[int], checksums: Sequence[int],
                 gens: Sequence[int]) -> list[ErrorCode]:
        """See tier_reads.register."""
        return tier_reads.register(self, client_id, segment_id, keys, sizes, checksums, gens)

    # -- time -------------------------------------------------------------------------------

    def tick(self) -> None:
        """Free transient copies whose lease ended; evict disks above their watermark;
        copy the cold end of DRAM ahead of eviction."""
        self.expire_transient()
        tier_offload.clean_ahead(self)
        cfg = self.config
        for mount in list(self.mounts.values()):
            alloc = mount.segment.allocator
            if alloc.used_bytes > cfg.disk_high_watermark * alloc.capacity:
                self.evict_disk(mount, alloc.used_bytes
                                - int(cfg.disk_low_watermark * alloc.capacity))

