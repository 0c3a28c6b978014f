"""The master's pending-puts table: puts between start and end (or revoke), by key, and each
segment's `pending_keys` index (the puts writing there). The only writer of both.

A reservation (reserve.py) is a pending put filed under its token until it is committed.
"""

from __future__ import annotations

from operator import attrgetter

from kvpool.store.master.keyed import KeyedReads
from kvpool.store.master.state import PendingPut, Segment

_client_of = attrgetter("client_id")


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

    def add_run(self, puts: list[PendingPut], segment: Segment) -> None:
        """add() of each of `puts`, whose keys are distinct and free and whose one replica
        each lies on `segment` (a batch's allocation run): one update of each index."""
        new = {put.key: put for put in puts}
        assert len(new) == len(puts) and self._by_key.keys().isdisjoint(new), \
            "a key pending twice"
        self._by_key.update(new)
        segment.pending_keys.update(new)

    def pop_run(self, client_id: str, keys: list[str]) -> list[PendingPut] | None:
        """pop() of each of `keys` (distinct) when every one is a put of `client_id`; None,
        changing nothing, when any is not. Each put's keys leave the index of every segment
        of the run (a key is indexed only where its own put is)."""
        by_key = self._by_key
        try:
            puts = list(map(by_key.get, keys))
        except TypeError:  # an unhashable key: none of this table's
            return None
        if None in puts or set(map(_client_of, puts)) != {client_id} \
                or len(set(keys)) != len(keys):
            return None
        for key in keys:
            del by_key[key]
        for segment in {r.segment for put in puts for r in put.replicas}:  # type: ignore[union-attr]
            segment.pending_keys.difference_update(keys)
        return puts  # type: ignore[return-value]

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
