"""The read path of the store client: look objects up (waiting out loads from a disk tier),
read each from its closest DRAM replica, verify the checksum, fall back to the next replica.

A mixin of ClientBase (base.py), which provides the RPC, the copies and the registry."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from kvpool.clock import Clock
from kvpool.errors import RpcFailed
from kvpool.log import get_logger
from kvpool.store.client.checksum import Hasher, HashOnArrival, parts_checksum
from kvpool.store.client.config import ClientConfig
from kvpool.store.client.early import Place, Places, still_named
from kvpool.store.client.plan import (
    Copy,
    Part,
    copies_for,
    dram_first,
    parts_total,
    valid_parts,
)
from kvpool.store.client.staging import StagingArea
from kvpool.store.client.types import ClientStats
from kvpool.store.wire import messages as m
from kvpool.store.wire.codes import (
    ErrorCode,
    LookupResult,
    ReadResult,
    ReplicaDesc,
    ReplicaState,
)
from kvpool.store.wire.validate import valid_key
from kvpool.transfer import OpCode, TransferEngine
from kvpool.transfer.routing import BegunRead

E = ErrorCode
log = get_logger("store.client")
_OK = E.OK
NOT_READY_PAUSE_S = 0.002
NOT_READY_MAX_PAUSE_S = 0.05
"""Pauses between lookups of an object being loaded from disk (doubling up to the max)."""


_READ_OK: dict[int, ReadResult] = {}


def read_ok(size: int) -> ReadResult:
    """ReadResult(OK, size), one shared instance per size (it is immutable)."""
    got = _READ_OK.get(size)
    if got is None:
        got = ReadResult(_OK, size)
        if len(_READ_OK) < 4096:
            _READ_OK[size] = got
    return got


class ReadPath:
    clock: Clock
    config: ClientConfig
    endpoint: str
    host: str
    stats: ClientStats
    _hasher: Hasher
    _staging: StagingArea
    _places: Places
    engine: TransferEngine

    if TYPE_CHECKING:
        def _call(self, msg: m.Msg) -> Any: ...

        def _call_keyed(self, keys: Sequence[str],
                        make: Callable[[list[str], int, int], m.Msg], refused: Any,
                        unpack: Callable[[Any], Any] = ...) -> list[Any]: ...

        def _registered(self, parts: Sequence[Part], writable: bool) -> bool: ...

        def _run_copies(self, op: OpCode, copies: dict[int, list[Copy]],
                        arrivals: HashOnArrival | None = None) -> set[int]: ...

    def _lookup(self, keys: Sequence[str]) -> tuple[list[LookupResult], float]:
        """Replica lookups (granting read leases) and the time they were first asked for.
        Objects the master is copying from disk into DRAM (REPLICA_IS_NOT_READY) are looked
        up again, with a growing pause, for up to `rpc_timeout_s`; so are objects found
        while others were still loading once more than half their lease passed (a loaded
        copy's lease is short, and the read starts only when the last one is in)."""
        t0 = self.clock.now()
        out = self._lookup_once(keys)
        granted = [0.0] * len(keys)  # when each lease began, seconds after t0
        pause = NOT_READY_PAUSE_S
        waiting = [i for i, r in enumerate(out) if r.code == E.REPLICA_IS_NOT_READY]
        while waiting and self.clock.now() + pause < t0 + self.config.rpc_timeout_s:
            self.clock.sleep(pause)  # (0 once, before a renewal; then the back-off again)
            pause = min(max(pause * 2, NOT_READY_PAUSE_S), NOT_READY_MAX_PAUSE_S)
            since_t0 = self.clock.now() - t0  # leases count from t0 for the caller
            for i, r in zip(waiting, self._lookup_once([keys[i] for i in waiting]),
                            strict=True):
                out[i] = r._replace(lease_ttl_s=r.lease_ttl_s + since_t0) if r.code == E.OK \
                    else r
                granted[i] = since_t0
            waiting = [i for i, r in enumerate(out) if r.code == E.REPLICA_IS_NOT_READY]
            if not waiting:  # all in: renew (once) leases more than half used meanwhile
                now = self.clock.now() - t0
                waiting = [i for i, r in enumerate(out) if r.code == E.OK
                           and granted[i] < since_t0
                           and now - granted[i] > (r.lease_ttl_s - granted[i]) / 2]
                pause = 0.0 if waiting else pause
        if len(keys) == 1:
            self._remember(keys[0], out[0])
        return out, t0

    def _remember(self, key: str, look: LookupResult) -> None:
        """Keep where a single-key lookup found `key` (its closest DRAM replica)."""
        self._placed(key, look.size, look.checksum, look.replicas if look.code is _OK else ())

    def _placed(self, key: str, size: int, checksum: int | None,
                replicas: Sequence[ReplicaDesc]) -> None:
        """Keep where `key` lives, among `replicas` (a single-key lookup's, or those this
        client's own single-key put wrote: its first read is then an early one too; named as
        a lookup names them once the put has ended)."""
        dram = dram_first(replicas, self.endpoint, self.host)
        self._places.remember(key, size, checksum,
                              dram[0]._replace(state=ReplicaState.COMPLETE) if dram else None)

    def _last_place(self, keys: Sequence[str]) -> Place | None:
        """Where the last lookup found a single key to read early (`_read_early`), if any."""
        return self._places.get(keys[0]) if len(keys) == 1 and self.config.early_reads \
            and self.config.verify_checksums else None

    def _read_early(self, key: str, last: Place,
                    parts: Sequence[Part]) -> tuple[LookupResult, float, bool] | None:
        """Read `key` into `parts` from the place its last lookup found it (`last`) while
        the master answers a new lookup (early.py): the read's frame goes out first on an
        idle connection, then the lookup, then the read's reply is taken if the answer still
        names the place (else the reply is given up unread), so the master connection is
        never held while a node answers, and a node the answer left is not waited for.
        (the new lookup, the time it was asked for, whether the bytes now in `parts` are the
        object's); None when nothing can be read early (the caller reads the ordinary way).
        When the bytes are not vouched for, the caller reads from the new lookup, less the
        place if its node did not answer in time (it is not waited for twice)."""
        size, _, place = last
        if len(parts) != 1 or place.endpoint == self.endpoint or not valid_parts(parts) \
                or parts[0][1] < size or not self._registered(parts, writable=True):
            return None
        (copy,) = copies_for(parts, place, size)
        began = self.engine.begin_read(copy.request(OpCode.READ))
        if began is None:
            return None
        t0 = self.clock.now()
        fresh = self._lookup_begun(key, began)
        served = still_named(size, place, fresh)
        if served:  # the bytes are the object's if they landed and hash to its checksum
            served = began.finish().ok and parts_checksum(parts, size) == fresh.checksum
            if began.timed_out:  # not waited for again by the ordinary read
                fresh = fresh._replace(replicas=tuple(r for r in fresh.replicas if r != place))
        else:
            began.abandon()
        self._remember(key, fresh)
        self.stats.add(early_reads=1, early_reads_refused=int(not served))
        return fresh, t0, served

    def _lookup_begun(self, key: str, began: BegunRead) -> LookupResult:
        """The lookup of `key` while `began` is out; it is given up if the lookup raises."""
        try:
            return self._call(m.GetReplicasMsg(keys=[key])).items[0]  # type: ignore[no-any-return]
        except RpcFailed as exc:
            return LookupResult(exc.code)
        except BaseException:
            began.abandon()
            raise

    def _lookup_once(self, keys: Sequence[str]) -> list[LookupResult]:
        valid = [i for i, k in enumerate(keys) if valid_key(k)]
        out = [LookupResult(E.INVALID_PARAMS)] * len(keys)
        if valid:
            items = self._call_keyed([keys[i] for i in valid],
                                     lambda chunk, lo, hi: m.GetReplicasMsg(keys=chunk),
                                     LookupResult, unpack=lambda reply: reply.items)
            for i, look in zip(valid, items, strict=True):
                out[i] = look
        return out

    def _read_relooked(self, keys: Sequence[str], looks: Sequence[LookupResult],
                       parts: Sequence[Sequence[Part] | None], t0: float) -> list[ReadResult]:
        """`_read`, then the objects whose lease ended before their bytes were in looked up
        and read again, up to `lease_retries` times within `rpc_timeout_s` of `t0`: a slow
        moment outlives a copy loaded from disk (its lease is short), and the object is
        still there to be read. What a last try leaves expired answers LEASE_EXPIRED, and
        so does an object whose size changed meanwhile (the parts were sized for the old)."""
        results = self._read(keys, looks, parts, t0)
        for _ in range(self.config.lease_retries):
            again = [i for i, r in enumerate(results) if r.code == E.LEASE_EXPIRED]
            if not again or self.clock.now() >= t0 + self.config.rpc_timeout_s:
                break
            self.stats.add(lease_retries=len(again))
            relooked, t1 = self._lookup([keys[i] for i in again])
            same = [(i, look) for i, look in zip(again, relooked, strict=True)
                    if look.code is not _OK or look.size == looks[i].size]
            reads = self._read([keys[i] for i, _ in same], [look for _, look in same],
                               [parts[i] for i, _ in same], t1)
            for (i, _), r in zip(same, reads, strict=True):
                results[i] = r
        return results

    def _read(self, keys: Sequence[str], looks: Sequence[LookupResult],
              parts: Sequence[Sequence[Part] | None], t0: float) -> list[ReadResult]:
        """Read each found object (`keys[i]`, looked up as `looks[i]`) into its parts from
        the closest replica, falling back to the next replica on failure or on bytes that
        fail the checksum (CHECKSUM_MISMATCH when no replica had the right bytes); each
        replica whose bytes failed is reported to the master, which drops it from the pool
        (store/master/damage.py). LEASE_EXPIRED when the read outlived the lease. On any
        failure the caller's parts hold undefined bytes."""
        results: list[ReadResult] = []
        queues: dict[int, list[ReplicaDesc]] = {}
        mismatched: set[int] = set()
        damaged: list[tuple[int, ReplicaDesc]] = []
        for i, (look, p) in enumerate(zip(looks, parts, strict=True)):
            if look.code is not _OK:
                results.append(ReadResult(look.code))
            elif p is None or not valid_parts(p) or parts_total(p) < look.size \
                    or not self._registered(p, writable=True):
                results.append(ReadResult(E.INVALID_PARAMS))
            elif queue := dram_first(look.replicas, self.endpoint, self.host):
                results.append(read_ok(look.size))
                queues[i] = queue
            else:  # disk replicas are read through a load, never directly
                results.append(ReadResult(E.TRANSFER_FAIL))
        verify = self.config.verify_checksums
        while queues:
            now = self.clock.now()
            for i in [i for i in queues if looks[i].lease_over(t0, now)]:
                results[i] = ReadResult(E.LEASE_EXPIRED)  # no replica of it is read any more:
                del queues[i]                             # its memory may hold another's
            if not queues:
                break
            copies = {i: copies_for(parts[i] or (), q[0], looks[i].size)
                      for i, q in queues.items()}
            arrivals = HashOnArrival({i: (parts[i] or (), looks[i].size) for i in queues
                                      if looks[i].checksum is not None}) if verify else None
            failed = self._run_copies(OpCode.READ, copies, arrivals)
            if arrivals is not None:
                bad = self._verify(looks, [i for i in queues if i not in failed], arrivals)
                mismatched |= bad
                failed |= bad
                damaged += [(i, queues[i][0]) for i in sorted(bad)]
            queues = {i: queues[i][1:] for i in failed}
            for i in [i for i, q in queues.items() if not q]:
                results[i] = ReadResult(E.CHECKSUM_MISMATCH if i in mismatched
                                        else E.TRANSFER_FAIL)
                del queues[i]
        return self._within_leases(keys, looks, t0, results, mismatched, damaged)

    def _within_leases(self, keys: Sequence[str], looks: Sequence[LookupResult], t0: float,
                       results: list[ReadResult], mismatched: set[int],
                       damaged: list[tuple[int, ReplicaDesc]]) -> list[ReadResult]:
        """A read's results, each object held to its own lease (a loaded copy's is short):
        bytes read after it ended may be reused memory, not the object's, and not damage
        either (LEASE_EXPIRED); the replicas whose bytes failed within it are reported."""
        now = self.clock.now()
        expired = {i for i, look in enumerate(looks) if look.lease_over(t0, now)}
        if expired:
            results = [ReadResult(E.LEASE_EXPIRED)
                       if i in expired and (r.ok or i in mismatched) else r
                       for i, r in enumerate(results)]
            damaged = [(i, replica) for i, replica in damaged if i not in expired]
        damaged = self._confirmed(looks, t0, damaged) if damaged else damaged
        if damaged:
            self._drop_damaged(keys, looks, damaged)
        return results

    def _confirmed(self, looks: Sequence[LookupResult], t0: float,
                   damaged: list[tuple[int, ReplicaDesc]]) -> list[tuple[int, ReplicaDesc]]:
        """Of `damaged`, the replicas whose bytes fail again when read into this client's own
        memory, within the lease. The caller's memory may have changed under the read
        (destination buffers that overlap, another thread writing them): the caller then
        gets CHECKSUM_MISMATCH all the same, but no healthy replica is dropped for it."""
        confirmed = []
        for i, replica in damaged:
            size, checksum = looks[i].size, looks[i].checksum
            addr, _, token = self._staging.acquire(size)
            try:
                failed = self._run_copies(OpCode.READ, {i: copies_for([(addr, size)], replica,
                                                                      size)})
                if not failed and not looks[i].lease_over(t0, self.clock.now()) and \
                        parts_checksum([(addr, size)], size) != checksum:
                    confirmed.append((i, replica))
            finally:
                self._staging.release(token)
        return confirmed

    def _drop_damaged(self, keys: Sequence[str], looks: Sequence[LookupResult],
                      damaged: list[tuple[int, ReplicaDesc]]) -> None:
        """Ask the master to drop each (object index, replica) whose bytes failed the
        checksum; counted in `stats.damaged_dropped` when it did. Best effort: a failed
        call leaves the replica to the next reader, who reports it again."""
        names = [keys[i] for i, _ in damaged]
        codes = self._call_keyed(
            names, lambda chunk, lo, hi: m.DropDamagedMsg(
                keys=chunk, segment_ids=[r.segment_id for _, r in damaged[lo:hi]],
                addrs=[r.addr for _, r in damaged[lo:hi]],
                checksums=[looks[i].checksum or 0 for i, _ in damaged[lo:hi]]),
            lambda code: code)
        dropped = sum(1 for code in codes if code == E.OK)
        self.stats.add(damaged_dropped=dropped)
        log.warning("dropped %d of %d damaged replicas from the pool (%s)", dropped,
                    len(damaged), ", ".join(sorted(set(names))[:4]))

    def _verify(self, looks: Sequence[LookupResult], read: list[int],
                arrivals: HashOnArrival) -> set[int]:
        """Indices among `read` whose bytes do not hash to their object's checksum."""
        got = arrivals.complete([i for i in read if looks[i].checksum is not None],
                                self._hasher)
        bad = {i for i, h in got.items() if h != looks[i].checksum}
        if bad:
            self.stats.add(checksum_mismatches=len(bad))
            log.warning("checksum mismatch on %d replica reads; trying other replicas",
                        len(bad))
        return bad
