"""A decode worker's KV reservations: request id -> the cache blocks a prefill worker pushes
that request's prompt KV into, held until the decode leg takes them or a deadline passes.

    reserve   add(rid, blocks)     deadline = clock.now() + ttl_s
    decode    take(rid)            the blocks go to the request (start_pushed)
    abort     take(rid)            the caller releases the blocks
    idle      take_expired()       reservations past their deadline; the caller releases them

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
    """On the table's clock: after it, `take_expired` hands the blocks back."""


class Reservations:
    def __init__(self, ttl_s: float, clock: Clock = SYSTEM_CLOCK) -> None:
        if ttl_s <= 0:
            raise InvalidArgument(f"reservation ttl_s must be > 0 (got {ttl_s})")
        self.ttl_s, self.clock = ttl_s, clock
        self._by_request: dict[str, Reservation] = {}

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

    def take_expired(self) -> list[tuple[str, list[int]]]:
        """Forget every reservation whose deadline has passed and return (request id,
        blocks) of each, oldest first, for the caller to release."""
        now = self.clock.now()
        gone = [(rid, held) for rid, held in self._by_request.items() if held.deadline < now]
        for rid, _ in gone:
            del self._by_request[rid]
        return [(rid, held.blocks)
                for rid, held in sorted(gone, key=lambda item: item[1].deadline)]

    def check_integrity(self) -> None:
        """AssertionError unless no block is held twice, every id is a valid block id, and
        no deadline is further than ttl_s ahead of the clock."""
        seen: set[int] = set()
        limit = self.clock.now() + self.ttl_s
        for rid, held in self._by_request.items():
            assert held.deadline <= limit, f"{rid} held until {held.deadline} > now + ttl {limit}"
            for block in held.blocks:
                assert block >= 0, f"{rid} holds block id {block}"
                assert block not in seen, f"block {block} reserved twice ({rid})"
                seen.add(block)
