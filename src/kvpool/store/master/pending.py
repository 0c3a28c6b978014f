"""The master's pending-puts table: puts between start and end (or revoke), by key, and each
segment's `pending_keys` index (the puts writing there). The only writer of both.

A reservation (reserve.py) is a pending put filed under its token until it is committed.
"""

from __future__ import annotations

from kvpool.store.master.keyed import KeyedReads
from kvpool.store.master.state import PendingPut


class PendingPuts(KeyedReads[PendingPut]):
    def __init__(self) -> None:
        self._by_key: dict[str, PendingPut] = {}

    # -- reads (a mapping of key -> PendingPut) -------------------------------------------

    def get(self, key: str) -> PendingPut | None:
        return self._by_key.get(key)

    def of_client(self, client_id: str) -> list[PendingPut]:
        return [p for p in self._by_key.values() if p.client_id == client_id]

    def started_before(self, horizon: float) -> list[PendingPut]:
        return [p for p in self._by_key.values() if p.started < horizon]

    # -- actions ---------------------------------------------------------------------------

    def add(self, put: PendingPut) -> None:
        """File `put` (its key must be free) and index it on its replicas' segments."""
        assert put.key not in self._by_key, f"{put.key!r} pending twice"
        self._by_key[put.key] = put
        for r in put.replicas:
            r.segment.pending_keys.add(put.key)

    def pop(self, key: str) -> PendingPut:
        """Forget the put of `key` and its index entries (its memory is the caller's)."""
        put = self._by_key.pop(key)
        for r in put.replicas:
            r.segment.pending_keys.discard(key)
        return put

    def rename(self, old_key: str, new_key: str, upsert: bool) -> None:
        """File the put of `old_key` (a reservation token) under `new_key` (free)."""
        put = self.pop(old_key)
        self.add(put._replace(key=new_key, upsert=upsert))

    def shift(self, gap_s: float) -> None:
        """Move every put's start `gap_s` later (the master's own stall is forgiven)."""
        for key, put in self._by_key.items():
            self._by_key[key] = put._replace(started=put.started + gap_s)

    def check_integrity(self) -> None:
        """AssertionError unless every put is filed under its key and indexed on each of
        its replicas' segments."""
        for key, put in self._by_key.items():
            assert put.key == key, f"{key!r} holds the put of {put.key!r}"
            for r in put.replicas:
                assert key in r.segment.pending_keys, f"pending {key!r} not indexed"
