"""Draining a store node: its objects move to other segments before it leaves.

The master carries no bytes: it marks the node's segments draining (placement skips them),
then hands a client batches of moves (a new pending range on a segment that stays, the
object's complete replicas to read from) and, when the client reports a verified copy,
swaps the new replica in for the drained one. Each move remembers the object it copies
(the StoredObject itself), so an upsert or remove meanwhile discards the move instead of
publishing stale bytes. Moves a client abandons are discarded after put_discard_timeout_s
and their range reused only after put_release_timeout_s, like a discarded put.

An object that has a replica elsewhere gets a new one too when some other segment has
room (the replica count stays); otherwise only its drained replica is dropped. An object
whose only replicas are drained and that fits nowhere stays where it is ("unplaced"):
nothing is ever evicted to make room for a drain.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from kvpool.store.master.state import Replica, Segment, StoredObject
from kvpool.store.wire.codes import ErrorCode, ReplicaState, Tier
from kvpool.store.wire.drain import DrainPlan, DrainStep, ReplicaMove, Unplaced

if TYPE_CHECKING:
    from kvpool.store.master.core_api import CoreApi

E = ErrorCode
_CODES = {int(c): c for c in ErrorCode}


class Move(NamedTuple):
    key: str
    obj: StoredObject
    """The version being copied: the move commits only while it is still the stored one."""
    source: Replica
    """The drained replica the new one replaces."""
    target: Replica
    client_id: str
    started: float


@dataclass(eq=False)
class Drain:
    """One address being drained."""

    address: str
    segments: list[Segment]
    unplaced: dict[str, ErrorCode] = field(default_factory=dict)
    """Keys found no room for during this drain: not offered again."""
    queue: deque[str] = field(default_factory=deque)

    def holds(self, seg: Segment) -> bool:
        return any(s is seg for s in self.segments)


class DrainManager:
    """The master's drains and in-flight moves (only writer of both)."""

    def __init__(self, core: CoreApi) -> None:
        self.core = core
        self.drains: dict[str, Drain] = {}
        self.moves: dict[str, Move] = {}

    # -- questions --------------------------------------------------------------------------

    def matching(self, address: str) -> list[Segment]:
        """Mounted segments whose owner endpoint or segment id is `address`."""
        return [s for s in self.core.segments.values()
                if address in (s.endpoint, s.segment_id)]

    def target_ranges(self) -> Iterator[Replica]:
        """The ranges allocated for moves in flight (for the integrity check)."""
        return (m.target for m in self.moves.values())

    def check(self) -> None:
        """AssertionError unless every drain and move refers to live tables."""
        for drain in self.drains.values():
            for seg in drain.segments:
                assert self.core.segments.get(seg.segment_id) is seg, \
                    f"drain of {drain.address} holds gone segment {seg.segment_id}"
                assert seg.draining, f"{seg.segment_id} is drained but not marked draining"
        for key, move in self.moves.items():
            assert key == move.key, f"move of {move.key!r} filed under {key!r}"
            assert all(r.segment is not move.target.segment for r in move.obj.replicas), \
                f"move of {key!r} targets a segment that holds a replica of it"

    def plan(self, address: str) -> DrainPlan:
        segs = self.matching(address)
        if not segs:
            return DrainPlan(E.SEGMENT_NOT_FOUND)
        keys = _keys_on(segs)
        objs = [self.core.objects[k] for k in keys]
        others = [s for s in self.core.segments.values() if not _drained(s, segs)]
        return DrainPlan(E.OK, tuple(s.segment_id for s in segs), len(objs),
                         sum(o.size for o in objs),
                         sum(1 for o in objs if _kept_replica(o, segs) is not None),
                         sum(s.capacity - s.allocator.used_bytes for s in others),
                         sum(len(s.pending_keys) for s in segs))

    # -- actions ----------------------------------------------------------------------------

    def begin(self, address: str, dry_run: bool = False) -> DrainPlan:
        """Mark `address`'s segments draining (placement skips them from now on) and say what
        is there; with `dry_run` only say. Beginning again (a drain whose client died)
        offers the unplaced objects again."""
        plan = self.plan(address)
        if plan.code != E.OK or dry_run:
            return plan
        segs = self.matching(address)
        for seg in segs:
            self.core.segments.set_draining(seg, True)
        self.drains[address] = Drain(address, segs)
        return plan

    def cancel(self, address: str) -> ErrorCode:
        """Stop draining `address`: its segments take placements again. Moves in flight may
        still end (they only add replicas elsewhere)."""
        drain = self.drains.pop(address, None)
        if drain is None:
            return E.SEGMENT_NOT_FOUND
        for seg in drain.segments:
            self.core.segments.set_draining(seg, any(d.holds(seg) for d in self.drains.values()))
        return E.OK

    def start(self, client_id: str, address: str, max_keys: int,
              max_bytes: int) -> DrainStep:
        """The next batch of moves of `address`: at most `max_keys` objects and (but for the
        first) `max_bytes` bytes. Each moved object gets a read lease, so its sources stay
        readable for lease_ttl_s."""
        drain = self.drains.get(address)
        if drain is None or not drain.segments:
            return DrainStep(E.SEGMENT_NOT_FOUND)
        now = self.core.clock.now()
        moves: list[ReplicaMove] = []
        unplaced: list[Unplaced] = []
        dropped = [0, 0]
        num_bytes = 0
        for key in self._next_keys(drain):
            if len(moves) >= max_keys or (moves and num_bytes >= max_bytes):
                drain.queue.appendleft(key)
                break
            move = self._plan_one(drain, key, client_id, now, unplaced, dropped)
            if move is not None:
                moves.append(move)
                num_bytes += move.size
        in_flight = sum(1 for m in self.moves.values() if drain.holds(m.source.segment)) \
            + sum(len(s.pending_keys) for s in drain.segments)
        done = not drain.queue and not in_flight and \
            all(k in drain.unplaced for s in drain.segments for k in s.keys)
        return DrainStep(E.OK, tuple(moves), dropped[0], dropped[1], tuple(unplaced),
                         in_flight, done)

    def _next_keys(self, drain: Drain) -> Iterator[str]:
        """Keys still on the drained segments, refilled once when the queue runs dry (puts
        that were writing there when the drain began end later)."""
        if not drain.queue:
            drain.queue = deque(k for k in _keys_on(drain.segments)
                                if k not in self.moves and k not in drain.unplaced)
        while drain.queue:
            yield drain.queue.popleft()

    def _plan_one(self, drain: Drain, key: str, client_id: str, now: float,
                  unplaced: list[Unplaced], dropped: list[int]) -> ReplicaMove | None:
        obj = self.core.objects.get(key)
        source = None if obj is None or key in self.moves else \
            next((r for r in obj.replicas if drain.holds(r.segment)), None)
        if obj is None or source is None:
            return None  # removed, replaced elsewhere, or already moving
        target = self._allocate(obj)
        if target is None and _kept_replica(obj, drain.segments) is not None:
            self._drop_replica(obj, source)
            dropped[0] += 1
            dropped[1] += obj.size
            return None
        if target is None:
            drain.unplaced[key] = E.NO_AVAILABLE_HANDLE
            unplaced.append(Unplaced(key, obj.size, E.NO_AVAILABLE_HANDLE))
            return None
        self.moves[key] = Move(key, obj, source, target, client_id, now)
        self.core.objects.extend_lease(obj, now + self.core.config.lease_ttl_s)
        return ReplicaMove(key, obj.size, obj.checksum, self.core.config.lease_ttl_s,
                           tuple(r.desc() for r in obj.replicas),
                           target.desc(ReplicaState.PENDING))

    def _allocate(self, obj: StoredObject) -> Replica | None:
        """A new range for `obj` on a segment that stays and holds no replica of it,
        preferring owners that hold none either; None when none has room."""
        held = {id(r.segment) for r in obj.replicas}
        owners = {r.segment.client_id for r in obj.replicas}
        ordered = self.core.placement.order(self.core.segment_list(), obj.size)
        ordered.sort(key=lambda s: s.client_id in owners)  # stable: placement order kept
        for seg in ordered:
            if id(seg) in held:
                continue
            offset = seg.allocator.allocate(obj.size)
            if offset is not None:
                return Replica(seg, offset, obj.size)
        return None

    def end(self, client_id: str, keys: Sequence[str],
            codes: Sequence[int]) -> list[ErrorCode]:
        """Finish moves: code 0 says the target holds the verified bytes (the new replica
        replaces the drained one: OK; or OBJECT_NOT_FOUND when the object was removed or
        replaced meanwhile and the copy is dropped); any other code gives the move up (OK)
        and leaves the object in place for the rest of this drain.
        LEASE_EXPIRED: no such move (discarded after put_discard_timeout_s, or its target
        segment left)."""
        if len(keys) != len(codes):
            return [E.INVALID_PARAMS] * len(keys)
        return [self._end_one(client_id, k, c) for k, c in zip(keys, codes, strict=True)]

    def _end_one(self, client_id: str, key: object, code: object) -> ErrorCode:
        if type(code) is not int or type(key) is not str:
            return E.INVALID_PARAMS
        move = self.moves.get(key)
        if move is None or move.client_id != client_id:
            return E.LEASE_EXPIRED
        del self.moves[move.key]
        if code != 0:
            self.core.space.free(move.target.segment, move.target.offset)
            self._give_up(move, code)
            return E.OK
        if self.core.objects.get(move.key) is not move.obj:
            self.core.space.free(move.target.segment, move.target.offset)
            return E.OBJECT_NOT_FOUND
        self._commit(move)
        return E.OK

    def _give_up(self, move: Move, code: int) -> None:
        """The client could not copy the object (its sources unreadable, or no replica
        matching its checksum): not offered again in this drain."""
        reason = _CODES.get(code, E.TRANSFER_FAIL)
        for drain in self.drains.values():
            if drain.holds(move.source.segment):
                drain.unplaced[move.key] = reason

    def _commit(self, move: Move) -> None:
        obj, target = move.obj, move.target
        self.core.objects.add_replica(obj, target)
        if move.source in obj.replicas:
            self._drop_replica(obj, move.source)  # journals the object
        elif self.core.journal is not None:
            self.core.journal.on_put(obj)

    def _drop_replica(self, obj: StoredObject, replica: Replica) -> None:
        """Take one replica out of an object that keeps another; its range is freed when
        the object's read lease ends (a reader may be copying from it). A disk replica
        goes through the disk tier (its file deleted, the object plain DRAM again)."""
        if replica.segment.tier is Tier.SSD:
            self.core.tiering.drop_disk_replica(obj, replica)
            return
        self.core.objects.drop_replica(obj, replica)
        self.core.space.free_after(replica, obj.lease_until)
        if self.core.journal is not None:
            self.core.journal.on_put(obj)

    # -- hooks called by the core -----------------------------------------------------------

    def on_drop(self, seg: Segment) -> None:
        """`seg` left the pool: moves into it are void (its memory is gone; their targets go
        on the release delay, which quarantine keeps should the same memory come back under
        the same fence while their writers may still copy), and it no longer belongs to a
        drain."""
        release = self.core.clock.now() + self.core.config.put_release_timeout_s
        for key in [k for k, m in self.moves.items() if m.target.segment is seg]:
            target = self.moves.pop(key).target
            self.core.space.release_at(release, seg, target.offset)
        for address, drain in list(self.drains.items()):
            drain.segments = [s for s in drain.segments if s is not seg]
            if not drain.segments:
                del self.drains[address]

    def discard_stale(self) -> int:
        """Discard moves older than put_discard_timeout_s; their writer may still be
        copying, so their ranges are reused only after put_release_timeout_s."""
        cfg = self.core.config
        now = self.core.clock.now()
        stale = [m for m in self.moves.values() if m.started < now - cfg.put_discard_timeout_s]
        for move in stale:
            del self.moves[move.key]
            self.core.space.release_at(now + cfg.put_release_timeout_s, move.target.segment,
                                       move.target.offset)
        return len(stale)

    def forgive_stall(self, gap_s: float) -> None:
        for key, move in self.moves.items():
            self.moves[key] = move._replace(started=move.started + gap_s)


def _keys_on(segs: Sequence[Segment]) -> list[str]:
    return list(dict.fromkeys(k for s in segs for k in s.keys))


def _drained(seg: Segment, segs: Sequence[Segment]) -> bool:
    return seg.draining or any(seg is s for s in segs)


def _kept_replica(obj: StoredObject, segs: Sequence[Segment]) -> Replica | None:
    """A replica of `obj` on a segment that stays (neither draining nor in `segs`)."""
    return next((r for r in obj.replicas if not _drained(r.segment, segs)), None)
