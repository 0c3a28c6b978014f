"""The batched fast paths of put_start and put_end: a whole batch in a few table updates.

Kept apart from MasterCore because they are optimisations, not new behaviour: when one
declines (returns None, having changed nothing) the per-key path gives the same answers.
Every check of the per-key path is made here too, once for the batch where it can be
(keys, sizes, checksums, ownership), each table written through its own methods.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

from kvpool.store.config import ReplicateConfig
from kvpool.store.master.state import PendingPut, Replica, StoredObject
from kvpool.store.wire.codes import ErrorCode, PutStartResult, ReplicaDesc, ReplicaState
from kvpool.store.wire.validate import valid_keys, valid_sizes

if TYPE_CHECKING:
    from kvpool.store.master.core_api import CoreApi

_new = tuple.__new__
_OK = ErrorCode.OK
_PENDING = ReplicaState.PENDING
_CHECKSUM_LIMIT = 1 << 64


def put_start_run(core: CoreApi, client_id: str, keys: Sequence[str],
                  sizes: Sequence[int], config: ReplicateConfig, upsert: bool,
                  now: float) -> list[PutStartResult] | None:
    """Fast path of a single-replica batch: every new key in one contiguous run on one
    segment the placement policy picks. None (nothing changed) when the batch has bad
    or existing keys, or no segment has a free range for the whole run."""
    if not (valid_keys(keys) and valid_sizes(sizes, core.config.max_object_bytes)) \
            or len(set(keys)) != len(keys) or core.pending.holds_any(keys) \
            or core.objects.holds_any(keys):
        return None
    for seg in core.placement.order(core.segment_list(), max(sizes)):
        offsets = seg.allocator.allocate_run(list(sizes))
        if offsets is not None:
            break
    else:
        return None
    seg_id, endpoint, base, tier, fence = (seg.segment_id, seg.endpoint, seg.base_addr,
                                           seg.tier, seg.fence)
    hard, soft = config.with_hard_pin, config.with_soft_pin
    puts, out = [], []
    for key, size, offset in zip(keys, sizes, offsets, strict=True):
        puts.append(_new(PendingPut, (key, size, [_new(Replica, (seg, offset, size))],
                                      client_id, now, upsert, hard, soft)))
        desc = _new(ReplicaDesc, (seg_id, endpoint, base + offset, size, tier, _PENDING,
                                  fence))
        out.append(_new(PutStartResult, (_OK, (desc,))))
    core.pending.add_run(puts, seg)
    return out


def put_end_run(core: CoreApi, client_id: str, keys: Sequence[str],
                checksums: Sequence[int | None], now: float) -> list[ErrorCode] | None:
    """Fast path of a batch that publishes new keys, each a put of `client_id` with a
    checksum: every one OK. None (nothing changed) when any key would answer otherwise,
    replace an object, or go without a checksum."""
    if len(checksums) != len(keys) or not _all_checksums(checksums) \
            or core.objects.holds_any(keys):
        return None
    puts = core.pending.pop_run(client_id, list(keys))
    if puts is None:
        return None
    soft_until = now + core.config.soft_pin_ttl_s
    objs = [StoredObject(put.key, put.size, put.replicas, 0.0, put.hard_pinned,
                         soft_until if put.soft_pinned else 0.0, checksum)
            for put, checksum in zip(puts, checksums, strict=True)]
    core.objects.insert_run(objs)
    if core.journal is not None:
        for obj in objs:
            core.journal.on_publish(obj)
    return [_OK] * len(objs)


def _all_checksums(checksums: Sequence[int | None]) -> bool:
    """Whether there are checksums and each is an int in [0, 2**64)."""
    if not checksums or set(map(type, checksums)) != {int}:
        return False
    values = cast("Sequence[int]", checksums)
    return min(values) >= 0 and max(values) < _CHECKSUM_LIMIT
