"""Damaged replicas: a reader whose bytes failed the object's checksum reports the replica,
and the master takes it out of the pool, so that the next reader reads a good replica or
finds nothing (the pool is a cache: its writer puts the object again) instead of the same
damaged bytes forever.

    DROP_DAMAGED [keys, segment_ids, addrs, checksums]
      per key: OK            the replica at (segment_id, addr) was dropped; the object too
                             when no other DRAM replica is left (or it has a disk copy,
                             which may hold the same bytes)
               OBJECT_NOT_FOUND  no such object, or it no longer has that replica with that
                             checksum (removed, replaced by a new put, already dropped):
                             nothing changed
               INVALID_PARAMS    columns of different lengths or values of the wrong type

The checksum and the address name the version the reader saw, so a report that arrives
after the object was put again never drops the new version. A dropped range is freed when
the object's read lease ends, as for a remove (a reader may still be copying from it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvpool.store.master.state import Replica, StoredObject
from kvpool.store.wire.codes import ErrorCode, Tier

if TYPE_CHECKING:
    from kvpool.store.master.core import MasterCore

E = ErrorCode


def drop_damaged(core: MasterCore, keys: Sequence[str], segment_ids: Sequence[str],
                 addrs: Sequence[int], checksums: Sequence[int]) -> list[ErrorCode]:
    """One code per key (see the module's table)."""
    if not len(keys) == len(segment_ids) == len(addrs) == len(checksums):
        return [E.INVALID_PARAMS] * len(keys)
    return [_drop_one(core, *row) for row in zip(keys, segment_ids, addrs, checksums,
                                                 strict=True)]


def _drop_one(core: MasterCore, key: object, segment_id: object, addr: object,
              checksum: object) -> ErrorCode:
    if type(key) is not str or type(segment_id) is not str or type(addr) is not int \
            or type(checksum) is not int:
        return E.INVALID_PARAMS
    obj = core.objects.get(key)
    replica = None if obj is None or obj.checksum != checksum else \
        _replica_at(obj, segment_id, addr)
    if obj is None or replica is None:
        return E.OBJECT_NOT_FOUND
    core.stats.damaged_dropped += 1
    others = [r for r in obj.replicas if r is not replica and r.segment.tier is Tier.DRAM]
    if not others or key in core.tiering.on_disk.tiered or len(others) + 1 < len(obj.replicas):
        core.remove_object(obj, defer=True)
        return E.OK
    core.objects.drop_replica(obj, replica)
    core.space.free_after(replica, obj.lease_until)
    if core.journal is not None:
        core.journal.on_put(obj)
    return E.OK


def _replica_at(obj: StoredObject, segment_id: str, addr: int) -> Replica | None:
    return next((r for r in obj.replicas if r.segment.segment_id == segment_id
                 and r.segment.base_addr + r.offset == addr), None)
