"""How KV enters and leaves an engine besides its own compute: the hooks a worker plugs in.

The engine calls, in its own thread and in this order for each step: `before_step()` (before
any block can be freed or reused), `load(seq)` for each newly admitted sequence (after its local prefix hits are allocated),
`before_forward(batch)`, `on_layer(i)` after layer i has written its KV, `after_forward()`,
and `on_finish(seq)` before a finished sequence's blocks are released (`on_abort(seq)` instead
when it ends with an error). The plain engine uses
`NullConnector`; the workers use `kvpool.engine.worker.pool.PoolConnector`.
"""

from __future__ import annotations

from kvpool.engine.scheduler import ScheduledBatch
from kvpool.engine.sequence import Sequence


class KVConnector:
    def before_step(self) -> None:
        """Nothing may still read or write the cache asynchronously after this returns."""

    def load(self, seq: Sequence) -> str | None:
        """Fill `seq`'s blocks past its local hits from elsewhere and advance
        `seq.num_computed_tokens`; return an error message to fail the request."""
        return None

    def before_forward(self, batch: ScheduledBatch) -> None:
        pass

    def on_layer(self, layer: int) -> None:
        pass

    def after_forward(self) -> None:
        pass

    def on_finish(self, seq: Sequence) -> str | None:
        """Called while `seq` still holds its blocks; an error message fails the request."""
        return None

    def on_abort(self, seq: Sequence) -> None:
        """`seq` ends with an error; forget whatever was kept for it."""


NullConnector = KVConnector
