"""Reserved puts on the client (the master's side is master/reserve.py).

A single-key put of a size seen before writes into space the master reserved for it ahead,
then publishes with one PUT_COMMIT, which reserves again for the next put of that size:

    put k1 (size s):  PUT_COMMIT [reserve s] -> token t1
                      write to t1
                      PUT_COMMIT [k1 <- t1, reserve s] -> t2
    put k2 (size s):  write to t2
                      PUT_COMMIT [k2 <- t2, reserve s] -> t3

so after the first put of a size each put is one transfer and one master round trip. The
object is visible to every client when PUT_COMMIT answers, as after PUT_END. A reservation
that cannot be used (the write failed: a re-mounted or dead node; the master dropped it) is
given up and the put takes the two-phase path. Reservations older than MAX_AGE_S are revoked
by the heartbeat thread, and all of them on close, so that space never sits idle for long.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from kvpool.clock import SYSTEM_CLOCK, Clock
from kvpool.errors import RpcFailed
from kvpool.store.client.checksum import parts_checksum
from kvpool.store.client.plan import Copy, Part
from kvpool.store.wire import messages as m
from kvpool.store.wire.codes import ErrorCode, PutResult, ReplicaDesc, Reservation
from kvpool.transfer import OpCode

E = ErrorCode
RESERVE_MAX_BYTES = 1 << 20
"""Larger objects take the two-phase path: their transfer dwarfs the saved round trip, and
idle reserved space would cost more."""
MAX_AGE_S = 5.0
"""Reservations unused this long are revoked (the master discards them after
put_discard_timeout_s, 30 s by default, and reuses such space only much later)."""
MAX_PER_SIZE = 2
MAX_SIZES = 4096
"""Sizes remembered as seen (`_seen`) before the memory of them starts again."""


class _Held(NamedTuple):
    token: str
    replicas: tuple[ReplicaDesc, ...]
    since_s: float


class ReservedPuts:
    """The reserved-put path of one client. `call` is the client's master call (raising
    RpcFailed), `copy` runs write copies and returns the indices that failed; the ages of
    held reservations are read from `clock`. The only writer of its held reservations."""

    def __init__(self, call: Callable[[m.Msg], Any],
                 copy: Callable[[OpCode, dict[int, list[Copy]]], set[int]],
                 copies_to: Callable[[Sequence[ReplicaDesc], Sequence[Part], int], list[Copy]],
                 write_checksums: bool, clock: Clock = SYSTEM_CLOCK,
                 placed: Callable[[str, int, int | None, tuple[ReplicaDesc, ...]], None]
                 = lambda key, size, checksum, replicas: None) -> None:
        self._call, self._copy, self._copies_to = call, copy, copies_to
        self._placed = placed
        """Told where each put published here placed its key (for reads from there)."""
        self._clock = clock
        self._write_checksums = write_checksums
        self._held: dict[int, list[_Held]] = {}
        self._sizes: set[int] = set()
        """Sizes put before (`_seen`)."""
        self._lock = threading.Lock()
        self.enabled = True
        """False once the master refused PUT_COMMIT (an older master)."""

    def put(self, key: str, parts: Sequence[Part], size: int, upsert: bool) -> PutResult | None:
        """The put of `key` through a reservation; None when it must take the two-phase
        path (nothing was published). Raises RpcFailed when the master cannot be reached
        during the commit (the put's outcome is then unknown, as with PUT_END)."""
        held = self._take(size) or (self._reserve(size) if self._seen(size) else None)
        if held is None:
            return None
        if self._copy(OpCode.WRITE, {0: self._copies_to(held.replicas, parts, size)}):
            self._revoke([held.token])
            return None
        checksum = parts_checksum(parts, size) if self._write_checksums else None
        reply = self._call(m.PutCommitMsg(keys=[key], tokens=[held.token], checksums=[checksum],
                                          upsert=upsert, reserve_sizes=[size]))
        self._keep(size, reply.reserved)
        code = reply.codes[0]
        if code is E.OBJECT_NOT_FOUND:  # the reservation is gone; nothing was published
            return None
        if code is not E.OK:  # refused before the reservation was used: it stays ours
            self._keep(size, [Reservation(E.OK, held.token, held.replicas)])
        if code is E.OBJECT_ALREADY_EXISTS and not upsert:
            return PutResult(E.OK, already_existed=True)
        if code is E.OK:
            self._placed(key, size, checksum, held.replicas)
        return PutResult(code)

    def _seen(self, size: int) -> bool:
        """Whether a put of this size came before (and note this one): a size's first put
        takes the two-phase path, so that sizes that never repeat leave no reservation to
        hold space for them."""
        with self._lock:
            if size in self._sizes:
                return True
            if len(self._sizes) >= MAX_SIZES:
                self._sizes.clear()
            self._sizes.add(size)
            return False

    def _take(self, size: int) -> _Held | None:
        with self._lock:
            stack = self._held.get(size)
            return stack.pop() if stack else None

    def _reserve(self, size: int) -> _Held | None:
        if not self.enabled:
            return None
        try:
            reply = self._call(m.PutCommitMsg(keys=[], tokens=[], checksums=[],
                                              reserve_sizes=[size]))
        except RpcFailed as exc:
            self.enabled = exc.code is not E.INVALID_PARAMS
            return None
        self._keep(size, reply.reserved)
        return self._take(size)

    def _keep(self, size: int, reserved: Sequence[Reservation]) -> None:
        extra = []
        with self._lock:
            stack = self._held.setdefault(size, [])
            for r in reserved:
                if r.code is not E.OK:
                    continue
                if len(stack) < MAX_PER_SIZE:
                    stack.append(_Held(r.token, r.replicas, self._clock.now()))
                else:
                    extra.append(r.token)
        if extra:
            self._revoke(extra)

    def take_stale(self, max_age_s: float = MAX_AGE_S) -> list[str]:
        """Forget reservations unused for `max_age_s` (all of them with 0) and return their
        tokens, for the caller to revoke."""
        now = self._clock.now()
        with self._lock:
            stale = [h.token for stack in self._held.values() for h in stack
                     if now - h.since_s >= max_age_s]
            for size, stack in list(self._held.items()):
                self._held[size] = [h for h in stack if now - h.since_s < max_age_s]
        return stale

    def held(self) -> dict[int, list[str]]:
        """The tokens held, by object size (a copy)."""
        with self._lock:
            return {size: [h.token for h in stack] for size, stack in self._held.items() if stack}

    def check_integrity(self) -> None:
        """AssertionError unless no token is held twice, no size holds more than
        MAX_PER_SIZE, every replica of a reservation has its size, and none is younger than
        the clock allows."""
        now, seen = self._clock.now(), set()
        with self._lock:
            for size, stack in self._held.items():
                assert len(stack) <= MAX_PER_SIZE, f"{len(stack)} reservations of size {size}"
                for h in stack:
                    assert h.token not in seen, f"reservation {h.token!r} held twice"
                    seen.add(h.token)
                    assert all(r.size == size for r in h.replicas), f"{h.token!r} is not {size} B"
                    assert h.since_s <= now, f"{h.token!r} held since {h.since_s} > now {now}"

    def _revoke(self, tokens: list[str]) -> None:
        """Best effort: a reservation the master is not told about is discarded by it
        after put_discard_timeout_s."""
        try:
            self._call(m.PutRevokeMsg(keys=tokens))
        except RpcFailed:
            pass
