"""Reads from a remembered place: a single-key get of a small object whose place this client
knows (its own single-key put placed it, or a single-key lookup found it) sends a read to that
replica, then its lookup to the master, then takes the read's reply (reads.py,
`ReadPath._read_early`). One round trip's wait instead of two.

The bytes are served only when the master's fresh answer vouches for them: the object is
there (OK), with the same size, the replica read is still one of its replicas (same segment,
address, size, tier, state and fence), and the bytes read hash to the object's checksum. So
what a caller gets is the object's value as of the master's answer, as in the ordinary read
(a place reused meanwhile for another object, a put in progress there, a segment mounted
again: the checksum or the replica list refuses it). Otherwise the read is done again the
ordinary way, from the fresh lookup (no second one), and nothing read early is reported as
damage. Objects without a checksum, or clients that do not verify, never read early.

    places = Places(limit)          # key -> (size, checksum, replica) where it was last seen
    places.remember(key, size, checksum, replica);  places.get(key)
    places.forget(keys);  places.clear()      # a client's own removes and upserts
    still_named(size, place, fresh) -> bool   # is the reply worth waiting for (then the bytes
                                              # are served if they hash to fresh.checksum)

Only single-key lookups are remembered (batches are never read early), as plain tuples of
strings and ints: the garbage collector stops tracking those, so a client that looks up many
keys does not make each collection walk the places it keeps (kept as named tuples, a turnover
of 32 places per batched lookup halved the batched calls' rate of a client holding 4,096).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from kvpool.store.wire.codes import ErrorCode, LookupResult, ReplicaDesc, ReplicaState, Tier

EARLY_READ_MAX_BYTES = 256 << 10
"""Objects up to this size are read early (a larger read takes long enough that the lookup's
round trip is a small part of it, and a refused one wastes more)."""
PLACES_KEPT = 4096
"""Keys whose last lookup a client remembers (the oldest forgotten first)."""
_OK = ErrorCode.OK


Place = tuple[int, int, ReplicaDesc]
"""(object size, checksum, the replica to read) of a key's last lookup."""


class Places:
    """Where this client's recent single-key lookups found small objects, for reads from a
    remembered place; safe to share between threads."""

    def __init__(self, limit: int = PLACES_KEPT) -> None:
        self._limit = limit
        self._found: dict[str, tuple[int, int, tuple[str, str, int, int, int, int, int]]] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._found)

    def get(self, key: str) -> Place | None:
        if type(key) is not str:  # (a bad key is INVALID_PARAMS at the master's call)
            return None
        got = self._found.get(key)
        if got is None:
            return None
        segment_id, endpoint, addr, size, tier, state, fence = got[2]
        return got[0], got[1], ReplicaDesc(segment_id, endpoint, addr, size, Tier(tier),
                                           ReplicaState(state), fence)

    def remember(self, key: str, size: int, checksum: int | None,
                 replica: ReplicaDesc | None) -> None:
        """Keep where `key` was found (`replica` None: it was not, or not in DRAM)."""
        if type(key) is not str:
            return
        with self._lock:
            found = self._found
            found.pop(key, None)
            if replica is None or checksum is None or not 0 < size <= EARLY_READ_MAX_BYTES:
                return
            r = replica
            found[key] = (size, checksum, (str(r.segment_id), str(r.endpoint), int(r.addr),
                                           int(r.size), int(r.tier), int(r.state),
                                           int(r.fence)))
            if len(found) > self._limit:
                del found[next(iter(found))]

    def forget(self, keys: Sequence[str]) -> None:
        with self._lock:
            for key in keys:
                if type(key) is str:
                    self._found.pop(key, None)

    def clear(self) -> None:
        with self._lock:
            self._found.clear()


def still_named(size: int, place: ReplicaDesc, fresh: LookupResult) -> bool:
    """Whether the master's answer `fresh` still names `place` for an object of `size` bytes
    with a checksum: else bytes read there can never be served (nor need to be waited for)."""
    return fresh.code is _OK and fresh.size == size and fresh.checksum is not None \
        and place in fresh.replicas
