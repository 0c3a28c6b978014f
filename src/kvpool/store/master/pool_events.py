"""The seam where the pool tells KV-event publishers what it holds (sans-I/O).

`ObjectTable`, the only writer of the master's objects, calls its `PoolEventSink` whenever a
key gains or loses its first/last complete copy on a medium, and `MasterCore.remove_all`
calls `cleared()` after a wipe that left nothing. Media are vLLM event medium names: "cpu"
(a DRAM segment) and "disk" (a node's SSD tier). The sink must not call back into the core;
it is called on the core's thread, inside the mutation.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from kvpool.store.master.state import Replica
from kvpool.store.wire.codes import Tier

MEDIUM_OF_TIER = {Tier.DRAM: "cpu", Tier.SSD: "disk"}


class PoolEventSink(Protocol):
    def stored(self, key: str, medium: str) -> None:
        """`key` now has a complete copy on `medium` (it had none there)."""

    def removed(self, key: str, medium: str) -> None:
        """`key` has no copy left on `medium`."""

    def cleared(self) -> None:
        """The pool holds no object at all any more (after a wipe)."""


def media_of(replicas: Iterable[Replica]) -> set[str]:
    return {MEDIUM_OF_TIER[r.segment.tier] for r in replicas}


def report_change(sink: PoolEventSink, key: str, before: set[str], after: set[str]) -> None:
    """Tell `sink` the media `key` gained and lost, in a fixed order (sorted)."""
    for medium in sorted(after - before):
        sink.stored(key, medium)
    for medium in sorted(before - after):
        sink.removed(key, medium)
