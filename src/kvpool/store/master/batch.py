"""The batched fast path of put_start: a whole single-replica batch as one allocation run.

Kept apart from MasterCore because it is an optimisation of `put_start`, not new behaviour:
when it declines (returns None) the per-key path gives the same answers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvpool.store.config import ReplicateConfig
from kvpool.store.master.state import PendingPut, Replica
from kvpool.store.wire.codes import ErrorCode, PutStartResult, ReplicaDesc, ReplicaState
from kvpool.store.wire.validate import valid_key, valid_size

if TYPE_CHECKING:
    from kvpool.store.master.core_api import CoreApi

_new = tuple.__new__


def put_start_run(core: CoreApi, client_id: str, keys: Sequence[str],
                  sizes: Sequence[int], config: ReplicateConfig, upsert: bool,
                  now: float) -> list[PutStartResult] | None:
    """Fast path of a single-replica batch: every new key in one contiguous run on one
    segment the placement policy picks. None (nothing changed) when the batch has bad
    or existing keys, or no segment has a free range for the whole run."""
    max_bytes = core.config.max_object_bytes
    for key, size in zip(keys, sizes, strict=True):
        if not valid_key(key) or not valid_size(size, max_bytes) or key in core.pending \
                or key in core.objects:
            return None
    if len(set(keys)) != len(keys):
        return None
    for seg in core.placement.order(core.segment_list(), max(sizes)):
        offsets = seg.allocator.allocate_run(list(sizes))
        if offsets is not None:
            break
    else:
        return None
    out = []
    for key, size, offset in zip(keys, sizes, offsets, strict=True):
        replicas = [_new(Replica, (seg, offset, size))]
        core.pending.add(_new(PendingPut, (key, size, replicas, client_id, now, upsert,
                                           config.with_hard_pin, config.with_soft_pin)))
        desc = _new(ReplicaDesc, (seg.segment_id, seg.endpoint, seg.base_addr + offset,
                                  size, seg.tier, ReplicaState.PENDING, seg.fence))
        out.append(_new(PutStartResult, (ErrorCode.OK, (desc,))))
    return out
