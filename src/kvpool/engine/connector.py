"""How KV enters and leaves an engine besides its own compute: the hooks a worker plugs in.

The engine calls, in its own thread and in this order for each step: `before_step()` (before
any block can be freed or reused), `load(seq)` for each newly admitted sequence (after its local prefix hits are allocated),
`before_forward(batch)`, `on_layer(i)` after layer i has written its KV, `after_forward()`,
and `on_finish(seq)` before a finished sequence's blocks are released (`on_abort(seq)` instead
when it ends with an error). The plain engine uses
`NullConnector`; the workers use `kvpool.engine.worker.pool.PoolConnector`.

`load` and `on_finish` return None when all went well, else a `KVFailure`: the request ends
with its reason, and a failed load names the cache blocks whose KV did not arrive (as vLLM's
connectors report `get_block_ids_with_load_errors()`).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.engine.scheduler import ScheduledBatch
from kvpool.engine.sequence import Sequence


@dataclass(frozen=True, slots=True)
class KVFailure:
    """Why a request's KV could not be loaded (`load`) or handed over (`on_finish`)."""

    reason: str
    """The request's error, as its caller sees it."""
    block_ids: frozenset[int] = frozenset()
    """Cache blocks (ids in the sequence's block table) a failed load left without their
    KV; empty when the failure is not about blocks (no pool, a push or put that failed)."""


class KVConnector:
    def before_step(self) -> None:
        """Nothing may still read or write the cache asynchronously after this returns."""

    def load(self, seq: Sequence) -> KVFailure | None:
        """Fill `seq`'s blocks past its local hits from elsewhere and advance
        `seq.num_computed_tokens`; a KVFailure fails the request."""
        return None

    def before_forward(self, batch: ScheduledBatch) -> None:
        pass

    def on_layer(self, layer: int) -> None:
        pass

    def after_forward(self) -> None:
        pass

    def on_finish(self, seq: Sequence) -> KVFailure | None:
        """Called while `seq` still holds its blocks; a KVFailure fails the request."""
        return None

    def on_abort(self, seq: Sequence) -> None:
        """`seq` ends with an error; forget whatever was kept for it."""


NullConnector = KVConnector
