"""Reserved puts: space for a client's next put of a given size, allocated ahead, so that a
put costs one master round trip (PUT_COMMIT) instead of two (PUT_START, PUT_END).

A reservation is a pending put held under a token instead of a key: the token starts with
a NUL character, which no valid key contains, so readers, removals and other clients can
never name it, and a random per-master prefix keeps tokens of a restarted master apart.
It lives and dies like any pending put (discarded after put_discard_timeout_s, revoked with
its client or segment). `commit` gives it its key and ends it in one step, with the same
checks as PUT_END: a put is visible to every client when the commit answers OK.

    PUT_COMMIT [keys, tokens, checksums, upsert, reserve_sizes]
        -> [[code per key], [Reservation per reserve size]]
"""

from __future__ import annotations

import itertools
import secrets
from typing import TYPE_CHECKING

from kvpool.store.config import ReplicateConfig
from kvpool.store.wire.codes import ErrorCode, Reservation
from kvpool.store.wire.validate import valid_key

if TYPE_CHECKING:
    from kvpool.store.master.core_api import CoreApi

E = ErrorCode
TOKEN_PREFIX = "\x00"
_DEFAULT = ReplicateConfig()


class Reservations:
    """Issues reservation tokens and turns reservations into objects, on one core."""

    def __init__(self, core: CoreApi) -> None:
        self.core = core
        self._prefix = f"{TOKEN_PREFIX}{secrets.token_hex(8)}:"
        self._ids = itertools.count(1)

    def reserve(self, client_id: str, size: int) -> Reservation:
        """Space for one future single-replica put of exactly `size` bytes."""
        core = self.core
        core.touch_client(client_id)
        token = f"{self._prefix}{next(self._ids)}"
        started = core.put_start_one(client_id, token, size, _DEFAULT, False, [],
                                     core.clock.now(), reserved=True)
        if started.code is not E.OK:
            return Reservation(started.code)
        return Reservation(E.OK, token, started.replicas)

    def commit(self, client_id: str, token: str, key: str, checksum: int | None,
               upsert: bool) -> ErrorCode:
        """Publish the bytes written to reservation `token` as object `key`. OBJECT_NOT_FOUND:
        the reservation is gone (discarded, revoked, another master): nothing is stored;
        OBJECT_ALREADY_EXISTS (plain put of a stored key): nothing changes and the
        reservation stays the client's."""
        core = self.core
        core.touch_client(client_id)
        put = core.pending.get(token) if token.startswith(TOKEN_PREFIX) else None
        if put is None or put.client_id != client_id:
            return E.OBJECT_NOT_FOUND
        if not valid_key(key):
            return E.INVALID_PARAMS
        if key in core.pending or (not upsert and key in core.objects):
            return E.OBJECT_ALREADY_EXISTS
        if checksum is not None and not 0 <= checksum < 1 << 64:
            return E.INVALID_PARAMS
        core.pending.rename(token, key, upsert)
        return core.put_end_one(client_id, key, checksum)
