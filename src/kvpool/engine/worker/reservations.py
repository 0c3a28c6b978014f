"""A decode worker's KV reservations: request id -> the cache blocks a prefill worker pushes
that request's prompt KV into, held until the decode leg takes them or a deadline passes.

    reserve   add(rid, blocks)     deadline = clock.now() + ttl_s
    decode    take(rid)            the blocks go to the request (start_pushed)
    abort     retire(rid)          the blocks are held until deadline + grace_s
    idle      retire_expired()     reservations past their deadline: held until + grace_s
              release_due()        held blocks whose time has come; the caller releases them

A push may still be writing a reservation's blocks after it was aborted or expired: its
prefill worker starts it only before the deadline (it is told `ttl_s`, and counts it from
before it asked), and a write that started runs at most `grace_s` (its transfer's timeouts).
So blocks of a reservation that was not taken go back to the cache only at deadline +
grace_s: never into another request's KV while a late push may land in them.

`Reservations` is the only writer of its map; the blocks themselves belong to the engine's
block manager, which the caller gives them back to. It runs on the engine thread (no lock)
and reads time from an injected clock (`kvpool.clock`), so expiry is tested on virtual time.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

from kvpool.clock import SYSTEM_CLOCK, Clock
from kvpool.errors import InvalidArgument


class Reservation(NamedTuple):
    blocks: list[int]
    """Block ids, in `push_parts` order."""
    deadline: float
    """On the table's clock: after it, the reservation is retired (`retire_expired`)."""


class Reservations:
    def __init__(self, ttl_s: float, clock: Clock = SYSTEM_CLOCK, grace_s: float = 0.0) -> None:
        if ttl_s <= 0 or grace_s < 0:
            raise InvalidArgument(f"reservation ttl_s must be > 0 and grace_s >= 0 (got "
                                  f"{ttl_s}, {grace_s})")
        self.ttl_s, self.clock, self.grace_s = ttl_s, clock, grace_s
        self._by_request: dict[str, Reservation] = {}
        self._retired: list[tuple[float, list[int]]] = []
        """(when they may go back, blocks) of reservations aborted or expired untaken."""

    # -- reads -----------------------------------------------------------------------------

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._by_request

    def __len__(self) -> int:
        return len(self._by_request)

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_request)

    def get(self, request_id: str) -> Reservation | None:
        return self._by_request.get(request_id)

    # -- actions ---------------------------------------------------------------------------

    def add(self, request_id: str, blocks: list[int]) -> Reservation:
        """Hold `blocks` for `request_id` until now + ttl_s. Raises InvalidArgument if the
        request already holds a reservation (nothing changes then: check `in` before
        allocating the blocks, so that none leak)."""
        if request_id in self._by_request:
            raise InvalidArgument(f"request {request_id} already holds a reservation")
        held = Reservation(list(blocks), self.clock.now() + self.ttl_s)
        self._by_request[request_id] = held
        return held

    def take(self, request_id: str) -> list[int] | None:
        """Forget the reservation of `request_id` and return its blocks (None: it holds
        none). The blocks are the caller's now: to start the request or to release."""
        held = self._by_request.pop(request_id, None)
        return held.blocks if held is not None else None

    def retire(self, request_id: str) -> bool:
        """The reservation of `request_id` will not be taken (an abort): its blocks go back at
        its deadline + grace_s (`release_due`). False if it holds none."""
        held = self._by_request.pop(request_id, None)
        if held is not None:
            self._retired.append((held.deadline + self.grace_s, held.blocks))
        return held is not None

    def retire_expired(self) -> list[str]:
        """Retire every reservation whose deadline has passed; their request ids, oldest
        first."""
        now = self.clock.now()
        gone = sorted(((rid, held) for rid, held in self._by_request.items()
                       if held.deadline < now), key=lambda item: item[1].deadline)
        for rid, _ in gone:
            self.retire(rid)
        return [rid for rid, _ in gone]

    def release_due(self) -> list[list[int]]:
        """The blocks of retired reservations whose grace has passed, for the caller to
        release (forgotten here)."""
        now = self.clock.now()
        due = [blocks for at, blocks in self._retired if at < now]
        if due:
            self._retired = [(at, blocks) for at, blocks in self._retired if at >= now]
        return due

    def check_integrity(self) -> None:
        """AssertionError unless no block is held twice, every id is a valid block id, and
        no deadline is further than ttl_s ahead of the clock."""
        seen: set[int] = set()
        limit = self.clock.now() + self.ttl_s
        for rid, held in self._by_request.items():
            assert held.deadline <= limit, f"{rid} held until {held.deadline} > now + ttl {limit}"
        held_by = [(rid, held.blocks) for rid, held in self._by_request.items()] + \
            [("(retired)", blocks) for _, blocks in self._retired]
        for rid, blocks in held_by:
            for block in blocks:
                assert block >= 0, f"{rid} holds block id {block}"
                assert block not in seen, f"block {block} reserved twice ({rid})"
                seen.add(block)
