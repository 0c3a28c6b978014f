"""The master's state machine: objects, segments, allocation, leases, eviction, liveness.

Sans-I/O: no sockets, no threads, no sleeping. Time comes from the injected Clock; the RPC
driver calls `tick()` periodically so timeouts fire. Every public call is batch-shaped and
returns one typed value per key; bad input yields INVALID_PARAMS for that key only.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvpool.clock import SYSTEM_CLOCK, Clock
from kvpool.store.allocator import OffsetAllocator
from kvpool.store.config import MasterConfig, ReplicateConfig
from kvpool.store.master import batch as master_batch
from kvpool.store.master.drain import DrainManager
from kvpool.store.master.evict import Evictor
from kvpool.store.master.eviction import create_eviction_policy
from kvpool.store.master.pending import PendingPuts
from kvpool.store.master.placement import create_placement, pick_segments
from kvpool.store.master.space import FreeSpace
from kvpool.store.master.state import ClientState, PendingPut, Replica, Segment, StoredObject
from kvpool.store.master.tables import ObjectTable, SegmentTable
from kvpool.store.master.tiering import Tiering
from kvpool.store.wire.codes import (
    ErrorCode,
    LookupResult,
    PutStartResult,
    ReplicaDesc,
    ReplicaState,
    SegmentInfo,
    Tier,
)
from kvpool.store.wire.validate import valid_key, valid_size

if TYPE_CHECKING:
    from kvpool.store.master.core_api import JournalHooks

E = ErrorCode
_new = tuple.__new__  # builds a NamedTuple without its Python-level __new__ (hot paths)
DEFAULT_REPLICATE = ReplicateConfig()
STALL_FRACTION = 0.5
"""A gap between two `tick()` calls longer than this fraction of client_ttl_s is the
master's own stall (SIGSTOP, swap, a long pause): nobody could be heard meanwhile, so every
deadline moves by the gap instead of everyone being declared dead."""


@dataclass
class MasterStats:
    discarded_puts: int = 0
    expired_clients: int = 0
    no_space: int = 0
    stalls_forgiven: int = 0
    damaged_dropped: int = 0
    """Replicas dropped because a reader found bytes that fail their checksum (damage.py)."""


class MasterCore:
    def __init__(self, config: MasterConfig | None = None, clock: Clock = SYSTEM_CLOCK) -> None:
        self.config = config or MasterConfig()
        self.clock = clock
        self.policy = create_eviction_policy(self.config.eviction_policy)
        self.objects = ObjectTable(self.policy)
        self.pending = PendingPuts()
        self.segments = SegmentTable()
        self.space = FreeSpace(self.segments, clock)
        """Deferred releases and the quarantine of dropped segments (space.py)."""
        self.clients: dict[str, ClientState] = {}
        self.placement = create_placement(self.config.allocation_strategy, self.config.seed)
        self.stats = MasterStats()
        self._last_tick = clock.now()
        self.journal: JournalHooks | None = None
        """Persistence (persist.py): told of every durable change, and of each tick."""
        self.tiering = Tiering(self)
        """The disk tier (tiering.py): inert until a node attaches one."""
        self.evictor = Evictor(self, self.tiering)
        self.drain = DrainManager(self)
        """Drains of store nodes and their moves in flight (drain.py)."""

    # -- clients and segments -------------------------------------------------------------

    def log_to(self, journal: JournalHooks) -> None:
        """Tell `journal` of every durable change and tick from now on."""
        self.journal = journal

    def heartbeat(self, client_id: str) -> ErrorCode:
        """Refresh a client's liveness. UNKNOWN_CLIENT tells it to mount its segments again
        (it was declared dead, or the master restarted); it is registered from now on."""
        client = self.clients.get(client_id)
        if client is None:
            self.clients[client_id] = ClientState(client_id, self.clock.now())
            return E.UNKNOWN_CLIENT
        client.last_seen = self.clock.now()
        return E.OK

    def touch_client(self, client_id: str) -> ClientState:
        """The client's state (registered now if unknown), marked alive now."""
        client = self.clients.get(client_id)
        if client is None:
            client = self.clients[client_id] = ClientState(client_id, self.clock.now())
        client.last_seen = self.clock.now()
        return client

    def mount_segment(self, client_id: str, endpoint: str, base_addr: int, size: int,
                      tier: Tier = Tier.DRAM, fence: int = 0) -> tuple[ErrorCode, str]:
        """Add [base_addr, base_addr + size) of `endpoint`'s process to the pool, guarded
        by the owner's write fence `fence` (a u64, 0 = none) that every replica descriptor
        there carries."""
        if not (valid_key(client_id) and valid_key(endpoint) and type(base_addr) is int
                and base_addr >= 0 and valid_size(size, 1 << 50)
                and base_addr + size < 1 << 64
                and type(fence) is int and 0 <= fence < 1 << 64):
            return E.INVALID_PARAMS, ""
        segment_id = f"{endpoint}/{base_addr:x}"
        existing = self.segments.get(segment_id)
        if existing is not None:
            if existing.client_id == client_id and existing.capacity == size \
                    and existing.fence == fence:
                return E.OK, segment_id
            self._drop_segment(existing)  # a restarted process, or a new fence: start empty
        client = self.touch_client(client_id)
        seg = Segment(segment_id, client_id, endpoint, base_addr,
                      OffsetAllocator(size, self.config.alignment), tier, fence)
        self.space.hold_quarantined(seg)
        self.segments.add(seg)
        client.segment_ids.add(segment_id)
        if self.journal is not None:
            self.journal.on_mount(self, seg)
        return E.OK, segment_id

    def unmount_segment(self, client_id: str, segment_id: str) -> ErrorCode:
        seg = self.segments.get(segment_id)
        if seg is None:
            return E.SEGMENT_NOT_FOUND
        if seg.client_id != client_id:
            return E.INVALID_PARAMS
        self._drop_segment(seg)
        return E.OK

    def _drop_segment(self, seg: Segment) -> None:
        """Forget a segment: replicas there vanish, objects left without one are removed,
        and puts that were writing there are revoked."""
        self.segments.remove(seg)
        self.drain.on_drop(seg)
        if self.journal is not None:
            self.journal.on_drop(seg.segment_id)
        client = self.clients.get(seg.client_id)
        if client is not None:
            client.segment_ids.discard(seg.segment_id)
        for key in list(seg.pending_keys):
            self._revoke(self.pending[key], by_master=True)
        self._hold_leased(seg)
        self.objects.drop_segment(seg)
        self.tiering.after_segment_dropped(seg)  # (its loads' targets held, then kept:)
        self.space.quarantine(seg)

    def _hold_leased(self, seg: Segment) -> None:
        """Ranges of `seg` a reader's lease still covers go on the release delay, so that
        quarantine keeps them if the same memory is mounted again under the same fence."""
        now = self.clock.now()
        for key in seg.keys:
            obj = self.objects.get(key)
            if obj is not None and obj.lease_until > now:
                for r in obj.replicas:
                    if r.segment is seg:
                        self.space.release_at(obj.lease_until, seg, r.offset)

    def expire_clients(self) -> list[str]:
        """Declare dead every client silent for longer than client_ttl_s."""
        horizon = self.clock.now() - self.config.client_ttl_s
        dead = [c for c in self.clients.values() if c.last_seen < horizon]
        for client in dead:
            for segment_id in list(client.segment_ids):
                self._drop_segment(self.segments[segment_id])
            for put in self.pending.of_client(client.client_id):
                self._revoke(put, by_master=True)
            del self.clients[client.client_id]
        self.stats.expired_clients += len(dead)
        return [c.client_id for c in dead]

    # -- puts ---------------------------------------------------------------------------

    def put_start(self, client_id: str, keys: Sequence[str], sizes: Sequence[int],
                  config: ReplicateConfig = DEFAULT_REPLICATE,
                  upsert: bool = False) -> list[PutStartResult]:
        """Allocate replicas for each key (state pending). The client writes them, then calls
        put_end (or put_revoke). A plain put of an existing key answers OBJECT_ALREADY_EXISTS
        and changes nothing."""
        if len(keys) != len(sizes) or config.replica_num > self.config.max_replicas:
            return [PutStartResult(E.INVALID_PARAMS)] * len(keys)
        self.touch_client(client_id)
        preferred = ([config.preferred_segment] if config.preferred_segment else []) \
            + list(config.preferred_segments)
        now = self.clock.now()
        if len(keys) > 1 and config.replica_num == 1 and not preferred:
            run = master_batch.put_start_run(self, client_id, keys, sizes, config, upsert, now)
            if run is not None:
                return run
        return [self.put_start_one(client_id, k, s, config, upsert, preferred, now)
                for k, s in zip(keys, sizes, strict=True)]

    def put_start_one(self, client_id: str, key: str, size: int, config: ReplicateConfig,
                      upsert: bool, preferred: list[str], now: float,
                      reserved: bool = False) -> PutStartResult:
        """put_start of one key. `reserved`: `key` is a reservation token
        (master/reserve.py), not a user key: it takes free space only, never evicting an
        object for a put that may not come (the object just committed included)."""
        if not (reserved or valid_key(key)) or not valid_size(size, self.config.max_object_bytes):
            return PutStartResult(E.INVALID_PARAMS)
        if key in self.pending or (not upsert and key in self.objects):
            return PutStartResult(E.OBJECT_ALREADY_EXISTS)
        replicas = self._place(size, config.replica_num, preferred) if reserved else \
            self.allocate(size, config.replica_num, preferred, now)
        if replicas is None:
            if not reserved:
                self.stats.no_space += 1
            return PutStartResult(E.NO_AVAILABLE_HANDLE)
        self.pending.add(_new(PendingPut, (key, size, replicas, client_id, now, upsert,
                                           config.with_hard_pin, config.with_soft_pin)))
        descs = []
        for r in replicas:
            seg = r.segment
            descs.append(_new(ReplicaDesc, (seg.segment_id, seg.endpoint,
                                            seg.base_addr + r.offset, size, seg.tier,
                                            ReplicaState.PENDING, seg.fence)))
        return _new(PutStartResult, (E.OK, tuple(descs)))

    def allocate(self, size: int, count: int, preferred: list[str],
                 now: float) -> list[Replica] | None:
        """`count` ranges of `size` bytes on distinct placeable segments (`preferred` ones
        first), evicting once when none are free; None when there is still no room."""
        replicas = self._place(size, count, preferred)
        if replicas is None and self.evictor.for_allocation(size, count, now):
            replicas = self._place(size, count, preferred)
        return replicas

    def _place(self, size: int, count: int, preferred: list[str]) -> list[Replica] | None:
        if len(self.segment_list()) < count:
            return None
        ordered = self.placement.order(self.segment_list(), size)
        if count == 1 and not preferred:  # the common case, without building a plan
            for seg in ordered:
                offset = seg.allocator.allocate(size)
                if offset is not None:
                    return [_new(Replica, (seg, offset, size))]
            return None
        chosen = pick_segments(ordered, preferred, size, count)
        if len(chosen) < count:
            return None
        replicas = []
        for seg in chosen:
            offset = seg.allocator.allocate(size)
            assert offset is not None, "can_allocate said yes"
            replicas.append(Replica(seg, offset, size))
        return replicas

    def segment_list(self) -> list[Segment]:
        """The segments that take new placements: DRAM ones that are not draining (puts and
        loaded copies go there)."""
        return self.segments.placeable()

    def put_end(self, client_id: str, keys: Sequence[str],
                checksums: Sequence[int | None] | None = None) -> list[ErrorCode]:
        """Publish written objects, each with the xxh3_64 of its bytes that readers verify
        (None: no checksum). OBJECT_NOT_FOUND: the put was discarded meanwhile (timeout, a
        target segment died) and the object is not stored."""
        self.touch_client(client_id)
        if checksums is None:
            checksums = [None] * len(keys)
        elif len(checksums) != len(keys):
            return [E.INVALID_PARAMS] * len(keys)
        if len(keys) > 1:
            run = master_batch.put_end_run(self, client_id, keys, checksums, self.clock.now())
            if run is not None:
                return run
        return [self.put_end_one(client_id, key, checksum)
                for key, checksum in zip(keys, checksums, strict=True)]

    def put_end_one(self, client_id: str, key: str, checksum: int | None) -> ErrorCode:
        """put_end of one key (see put_end)."""
        if checksum is not None and not (type(checksum) is int and 0 <= checksum < 1 << 64):
            return E.INVALID_PARAMS
        put = self.pending.get(key) if type(key) is str else None
        if put is None or put.client_id != client_id:
            return E.OBJECT_NOT_FOUND
        self.pending.pop(key)
        old = self.objects.get(key)
        if old is not None:
            self.remove_object(old, defer=True)
        now = self.clock.now()
        soft_until = now + self.config.soft_pin_ttl_s if put.soft_pinned else 0.0
        self.objects.insert(StoredObject(key, put.size, put.replicas, 0.0, put.hard_pinned,
                                         soft_until, checksum))
        if self.journal is not None:
            self.journal.on_publish(self.objects[key])
        return E.OK

    def put_revoke(self, client_id: str, keys: Sequence[str]) -> list[ErrorCode]:
        self.touch_client(client_id)
        out = []
        for key in keys:
            put = self.pending.get(key) if type(key) is str else None
            if put is None or put.client_id != client_id:
                out.append(E.OBJECT_NOT_FOUND)
            else:
                self._revoke(put)
                out.append(E.OK)
        return out

    def _revoke(self, put: PendingPut, by_master: bool = False) -> None:
        """Forget a pending put. Revoked by its client, the memory is free at once; revoked
        by the master (timeout, dead client or segment), the writer may still be copying, so
        the memory is reused only after put_release_timeout_s."""
        self.pending.pop(put.key)
        release_at = self.clock.now() + self.config.put_release_timeout_s
        for r in put.replicas:
            if by_master:
                self.space.release_at(release_at, r.segment, r.offset)
            else:
                self.space.free(r.segment, r.offset)

    def forgive_stall(self, gap_s: float) -> None:
        """Move every liveness and put deadline `gap_s` later: time the master spent stopped
        is no client's silence, and heartbeats sent meanwhile are still queued unread."""
        for client in self.clients.values():
            client.last_seen += gap_s
        self.pending.shift(gap_s)
        self.drain.forgive_stall(gap_s)
        self.stats.stalls_forgiven += 1

    def discard_stale_puts(self) -> int:
        horizon = self.clock.now() - self.config.put_discard_timeout_s
        stale = self.pending.started_before(horizon)
        for put in stale:
            self._revoke(put, by_master=True)
        self.stats.discarded_puts += len(stale)
        return len(stale)

    # -- reads and removal ----------------------------------------------------------------

    def get_replicas(self, keys: Sequence[str]) -> list[LookupResult]:
        """Replicas of complete objects; each found object gets a read lease."""
        ttl = self.config.lease_ttl_s
        until = self.clock.now() + ttl
        touch, extend_lease = self.policy.on_access, self.objects.extend_lease
        tiered = self.tiering.on_disk.tiered
        out = []
        for key in keys:
            obj = self.objects.get(key) if type(key) is str else None
            if obj is None:
                out.append(LookupResult(E.INVALID_PARAMS if not valid_key(key)
                                        else E.OBJECT_NOT_FOUND))
                continue
            if key in tiered:  # on disk: the tier answers unless a plain DRAM copy exists
                answer = self.tiering.on_lookup(obj)
                if answer is not None:
                    out.append(answer)
                    continue
            extend_lease(obj, until)
            touch(key)
            descs = tuple([_new(ReplicaDesc, (r.segment.segment_id, r.segment.endpoint,
                                              r.segment.base_addr + r.offset, r.size,
                                              r.segment.tier, ReplicaState.COMPLETE,
                                              r.segment.fence))
                           for r in obj.replicas])
            out.append(_new(LookupResult, (E.OK, obj.size, descs, ttl, obj.checksum)))
        return out

    def exists(self, keys: Sequence[str]) -> list[ErrorCode]:
        return [E.OK if type(k) is str and k in self.objects
                else (E.OBJECT_NOT_FOUND if valid_key(k) else E.INVALID_PARAMS) for k in keys]

    def remove(self, keys: Sequence[str], force: bool = False) -> list[ErrorCode]:
        now = self.clock.now()
        out = []
        for key in keys:
            obj = self.objects.get(key) if type(key) is str else None
            if obj is None and self.journal is not None and valid_key(key) \
                    and self.journal.remove_recovering(key):
                out.append(E.OK)  # its segment is not back yet: it never will be served
            elif obj is None:
                out.append(E.OBJECT_NOT_FOUND if valid_key(key) else E.INVALID_PARAMS)
            elif obj.lease_until > now and not force:
                out.append(E.OBJECT_HAS_LEASE)
            else:
                self.remove_object(obj, defer=True)
                out.append(E.OK)
        return out

    def remove_all(self, force: bool = False) -> int:
        removed = self._remove_matching(lambda key: True, force)
        if removed and not len(self.objects) and self.objects.events is not None:
            self.objects.events.cleared()
        return removed

    def remove_regex(self, pattern: str, force: bool = False) -> int:
        """Remove every key matching `pattern` (re.search); -600 for a bad pattern."""
        try:
            compiled = re.compile(pattern)
        except (re.error, TypeError):
            return int(E.INVALID_PARAMS)
        return self._remove_matching(lambda key: compiled.search(key) is not None, force)

    def _remove_matching(self, match: object, force: bool) -> int:
        now = self.clock.now()
        victims = [o for o in self.objects.values()
                   if (force or o.lease_until <= now) and match(o.key)]  # type: ignore[operator]
        for obj in victims:
            self.remove_object(obj, defer=True)
        return len(victims)

    def remove_object(self, obj: StoredObject, defer: bool) -> None:
        """Drop an object; with `defer`, memory a live lease may still be read from is
        freed only when the lease ends."""
        if self.tiering.watching:
            self.tiering.on_remove(obj)  # may hold ranges a node task is using
        self.objects.remove(obj)
        if self.journal is not None:
            self.journal.on_remove(obj.key)
        for r in obj.replicas:
            self.space.free_after(r, obj.lease_until if defer else 0.0)

    def unpublish(self, obj: StoredObject, hold: bool = False) -> None:
        """Take back a put whose record the journal did not write, before anyone read it:
        the object goes without a record. Its memory is free at once (the put's reply says
        it failed, so no writer or reader uses it), or with `hold` kept allocated until
        `space.release_held` (the write failed, and may have landed all the same)."""
        if self.objects.get(obj.key) is not obj:
            return
        if self.tiering.watching:
            self.tiering.on_remove(obj)
        self.objects.remove(obj)
        for r in obj.replicas:
            if hold:
                self.space.hold(r)
            else:
                self.space.free_after(r, 0.0)

    def release_deferred(self) -> int:
        """Free the ranges whose release time has come (see space.FreeSpace)."""
        return self.space.release_due()

    # -- housekeeping and inspection ------------------------------------------------------

    def evict(self, num_bytes: int) -> bool:
        """Free about `num_bytes` (see evict.evict); whether anything was freed."""
        return self.evictor.evict(num_bytes)

    def _eviction_target(self) -> int:
        return self.evictor.target()

    def tick(self) -> None:
        """Run every timeout that is due, then evict if above the high watermark. A long
        gap since the previous tick is the master's own stall, forgiven first."""
        now = self.clock.now()
        gap, self._last_tick = now - self._last_tick, now
        if gap > STALL_FRACTION * self.config.client_ttl_s:
            self.forgive_stall(gap)
        self.expire_clients()
        self.discard_stale_puts()
        self.drain.discard_stale()
        self.release_deferred()
        self.tiering.tick()
        capacity = self.segments.dram_capacity
        if capacity and self.used_bytes > self.config.high_watermark * capacity:
            self.evict(self._eviction_target())
        if self.journal is not None:
            self.journal.on_tick(self)

    @property
    def capacity_bytes(self) -> int:
        return self.segments.dram_capacity

    @property
    def used_bytes(self) -> int:
        """Allocated DRAM bytes over all segments (summed on demand: segments are few and the
        put path stays free of bookkeeping)."""
        return sum(s.allocator.used_bytes for s in self.segments.dram())

    def segment_infos(self) -> list[SegmentInfo]:
        return [s.info() for s in self.segments.values()]

    def check_integrity(self) -> None:
        """AssertionError unless every table agrees with every other and with the allocators."""
        from kvpool.store.master.check import check_master
        check_master(self, self.tiering, self.drain)
