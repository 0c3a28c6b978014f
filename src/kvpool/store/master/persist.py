"""Master persistence: every acknowledged change is a record in a journal, replayed on start.

The journal's storage is a `LogStore`: a state directory (`log_files.FileLogStore`: a
snapshot plus append-only logs) or etcd (`log_etcd.EtcdLogStore`, for HA masters that share
nothing but etcd). Opening one replays the snapshot and every newer log record, writes the
result as a new snapshot and starts an empty log. Compaction at run time does the same from
the live tables once the log passes `compact_bytes` (under the master's lock; no request is
served meanwhile).

What is acknowledged is durable: the service writes the records a request produced to the
log before its reply leaves (`PersistentService`). When that write fails (a full disk, an
I/O error, etcd unreachable) the request is answered RPC_FAIL and the objects it published
are taken back before anyone else can see them (they were never acknowledged); its other
records (removes, mounts, drops, replica changes: done in memory and not undone) are kept
and written ahead of the next request's, so the log catches up with the tables once the
disk has room again. For a directory, `fsync` says when they
reach the disk: "always" before each reply (survives a machine crash), "interval" every
fsync_interval_s (a process crash loses nothing, a power loss up to that interval), "never"
(the OS decides). etcd acknowledges a write once its quorum has it on disk.

A restarted master knows its objects but not their memory's owners: each recovered segment
waits for its node to mount again (same client id, endpoint, base address and size; the
node brings a new fence, which the objects then carry). Only then are its objects served.
Segments not back within `recovery_grace_s` are dropped with their objects.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from kvpool.errors import ConfigError, JournalWriteError
from kvpool.log import RateLimitedLog, get_logger
from kvpool.store.master.log_files import FileLogStore, load_state
from kvpool.store.master.records import DurableState, ObjRec, SegRec, encode_record
from kvpool.store.master.recovery import Recovery
from kvpool.store.master.replay import JournalStats, ReplayReport
from kvpool.store.master.service import MasterService
from kvpool.store.master.state import Segment, StoredObject
from kvpool.store.wire.codes import ErrorCode
from kvpool.store.wire.protocol import encode_reply, peek_req_id

if TYPE_CHECKING:
    from kvpool.store.master.core import MasterCore
    from kvpool.store.master.core_api import CoreApi

log = get_logger("store.persist")
FSYNC_POLICIES = ("always", "interval", "never")
__all__ = ["FSYNC_POLICIES", "Journal", "LogStore", "PersistConfig", "PersistentService",
           "load_state"]


class LogStore(Protocol):
    """Where a journal's snapshot and log live."""

    durable_on_append: bool
    """True when `append` returns only once the data is durable (no `sync` needed)."""
    report: ReplayReport
    """What the last `load` skipped."""

    def where(self) -> str: ...

    def load(self) -> DurableState:
        """The state the snapshot and the logs after it add up to."""

    def rotate(self, records: list[bytes], term: int) -> None:
        """Make `records` (encoded) the state and start an empty log; raises StoreError
        when a later term owns the store."""

    def append(self, records: list[bytes]) -> bool:
        """Add encoded records to the log; False when refused (closed, or fenced out by a
        later term): the caller must not acknowledge them. JournalWriteError when the
        write failed; none of `records` is then in the log."""

    def sync(self) -> None:
        """Make appended records durable; JournalWriteError (those since the last sync are
        then not in the log) when that fails."""

    def close(self) -> None: ...


@dataclass(frozen=True)
class PersistConfig:
    state_dir: str
    """Directory of the snapshot and log (created if missing); '' with `etcd`."""
    fsync: str = "always"
    """'always' (before each reply), 'interval' or 'never' (see the module docstring)."""
    fsync_interval_s: float = 1.0
    compact_bytes: int = 64 << 20
    """Log size that triggers a snapshot of the live tables."""
    recovery_grace_s: float = 30.0
    """How long recovered segments wait for their nodes to mount again."""
    etcd: str = ""
    """etcd endpoints ('h1:2379;h2:2379') to keep the journal in instead of a directory."""
    cluster_id: str = "kvpool"
    """Names the journal's keys in etcd (/kvpool/<cluster_id>/master/state/...)."""
    recover_partial: bool = False
    """Start even when the snapshot that later logs depend on is missing or damaged,
    keeping what the remaining files hold (otherwise loading raises StateDamaged)."""

    def __post_init__(self) -> None:
        if self.fsync not in FSYNC_POLICIES:
            raise ConfigError(f"fsync must be one of {FSYNC_POLICIES}, got {self.fsync!r}")
        if not 0.001 <= self.fsync_interval_s <= 3600:
            raise ConfigError(f"fsync_interval_s must be in [0.001, 3600], got "
                              f"{self.fsync_interval_s}")
        if not 1 << 10 <= self.compact_bytes <= 1 << 40:
            raise ConfigError(f"compact_bytes must be in [1 KiB, 1 TiB], got "
                              f"{self.compact_bytes}")
        if not 0 <= self.recovery_grace_s <= 86400:
            raise ConfigError(f"recovery_grace_s must be in [0, 86400], got "
                              f"{self.recovery_grace_s}")


def open_log_store(config: PersistConfig, term: int) -> LogStore:
    """The journal's storage: the state directory, or etcd when `config.etcd` is set."""
    if config.etcd:
        from kvpool.store.master.log_etcd import EtcdLogStore
        return EtcdLogStore(config.etcd, config.cluster_id, term)
    if not config.state_dir:
        raise ConfigError("persistence needs a state directory or etcd endpoints")
    return FileLogStore(config.state_dir, config.recover_partial, config.fsync == "always")


class Journal:
    """The log writer and recovery of one master; the core calls its `on_*` hooks."""

    def __init__(self, config: PersistConfig, core: CoreApi, term: int = 0,
                 store: LogStore | None = None) -> None:
        self.config = config
        self.store = store if store is not None else open_log_store(config, term)
        state = self.store.load()
        log.info("state %s: %d segments and %d objects recovered", self.store.where(),
                 len(state.segments), len(state.objects))
        _warn_damage(self.store.where(), self.store.report)
        self.recovery = Recovery(state, core.clock.now() + config.recovery_grace_s)
        self.term = term or state.term  # a single master keeps the term it found
        self._core = core
        self._open = True
        self._buf: list[bytes] = []
        self._published: list[tuple[StoredObject, bytes]] = []
        """Objects the buffered records publish, with their record (taken back, record
        and object, if the write fails)."""
        self._carry: list[bytes] = []
        """Records of failed writes that stay done in memory, written ahead of the next."""
        self._holding = False
        """Whether memory of voided puts is held (`_void`)."""
        self.num_write_failures = 0
        self._num_failing = 0
        """Failed writes since the last one that succeeded."""
        self.write_error: str | None = None
        """Why the last write failed, while the journal has not written since."""
        self._failures = RateLimitedLog(log, 10.0)
        self._log_bytes = 0
        self._last_sync = core.clock.now()
        self.fence: Callable[[], bool] | None = None
        """With HA: whether this master still leads; records are written only then."""
        self._rotate(state.records())

    def _rotate(self, records: list[list[Any]]) -> None:
        """Write `records` as the snapshot and start an empty log."""
        self.commit()
        self.store.rotate([encode_record(r) for r in records], self.term)
        self._log_bytes = 0
        self._carry = []  # the snapshot holds what they recorded
        self._release_held()  # and none of the failed writes' records

    # -- hooks called by the core (under the master's lock) ------------------------------

    def on_mount(self, core: CoreApi, seg: Segment) -> None:
        if not self.recovery.matches(seg):
            if self.recovery.give_up(seg.segment_id):
                self._append(["D", seg.segment_id])
        self._append(SegRec(seg.segment_id, seg.client_id, seg.endpoint, seg.base_addr,
                            seg.capacity, int(seg.tier), seg.fence).record())
        dropped, changed = self.recovery.reattach(core, seg)
        for key in dropped:
            self._append(["R", key])
        for obj in changed:
            self.on_put(obj)

    def on_drop(self, segment_id: str) -> None:
        self._append(["D", segment_id])

    def on_put(self, obj: StoredObject) -> None:
        """`obj` changed (its replicas, its tier)."""
        self._append(["P", obj.key, obj.size,
                      [[r.segment.segment_id, r.offset] for r in obj.replicas],
                      obj.checksum, obj.hard_pinned])

    def on_publish(self, obj: StoredObject) -> None:
        """`obj` was just put: if its record cannot be written, the object is taken back.
        A recovered value of the same key still waiting for its node is gone for good."""
        self.on_put(obj)
        self._published.append((obj, self._buf[-1]))
        if not self.recovery.done:
            self.recovery.forget(obj.key)

    def on_remove(self, key: str) -> None:
        self._append(["R", key])
        if not self.recovery.done:
            self.recovery.forget(key)

    def remove_recovering(self, key: str) -> bool:
        """Remove an object whose segment has not come back yet; whether there was one
        (the core then answers OK instead of OBJECT_NOT_FOUND)."""
        if not self.recovery.forget(key):
            return False
        self._append(["R", key])
        return True

    def on_tick(self, core: CoreApi) -> None:
        if self.fence is not None and not self.fence():
            self._write()  # refused: drops the buffer, takes back what it published
            return
        for segment_id in self.recovery.expire(core.clock.now()):
            self._append(["D", segment_id])
        if self._buf or self._carry:
            self._write()
        now = core.clock.now()
        if self.config.fsync == "interval" and not self.store.durable_on_append and \
                now - self._last_sync >= self.config.fsync_interval_s:
            self._sync(now)
        if self._log_bytes > self.config.compact_bytes and self.recovery.done:
            try:
                self.compact(core)
            except JournalWriteError as exc:
                self._failures.warn("journal compaction failed (retried next tick): %s", exc)

    # -- writing ------------------------------------------------------------------------

    def _append(self, payload: list[Any]) -> None:
        self._buf.append(encode_record(payload))

    def commit(self) -> bool:
        """Write buffered records to the log (and fsync under the 'always' policy); False
        when they were not written (this master no longer leads, is closed, or the write
        failed: see `write_error`): the objects they published are then taken back."""
        return self._write() if self._buf else True

    def _write(self) -> bool:
        """Write the carried and the buffered records as one append."""
        published, self._published = self._published, []
        if not self._open or (self.fence is not None and not self.fence()):
            self._buf.clear()
            self._take_back(published)
            return False
        records, self._buf = self._carry + self._buf, []
        try:
            if not self.store.append(records):
                self._take_back(published)
                return False
            if self.config.fsync == "always" and not self.store.durable_on_append:
                self.store.sync()
        except JournalWriteError as exc:
            self._failed(records, published, exc)
            return False
        self._wrote(records)
        if self.fence is not None and not self.fence():
            # the lease lapsed during the write: a successor may have loaded the journal
            # before it landed, so it is acknowledged to nobody
            self._void(published)
            return False
        return True

    def _failed(self, records: list[bytes], published: list[tuple[StoredObject, bytes]],
                exc: JournalWriteError) -> None:
        """Keep what stays done in memory for the next write; take back the puts."""
        unpublished = {id(rec) for _, rec in published}
        self._carry = [r for r in records if id(r) not in unpublished]
        if exc.may_have_landed:
            self._void(published)
        else:
            self._take_back(published)
        self.num_write_failures += 1
        self._num_failing += 1
        self.write_error = str(exc)
        self._failures.warn("journal write failed, %d puts taken back, %d records kept "
                            "for the next write: %s", len(published), len(self._carry), exc)

    def _take_back(self, published: list[tuple[StoredObject, bytes]]) -> None:
        """Take back puts none of whose records was written."""
        for obj, _ in published:
            self._core.unpublish(obj)

    def _void(self, published: list[tuple[StoredObject, bytes]]) -> None:
        """Take back puts whose records a write that failed may have written all the same
        (etcd applied it, the log kept it): a remove of each is carried to the next write,
        and their memory is held until that write has voided them (released in `_wrote`,
        `_rotate`), so no other put can reuse it under a record that a replay may still
        find."""
        self._carry += [encode_record(["R", obj.key]) for obj, _ in published]
        for obj, _ in published:
            self._core.unpublish(obj, hold=True)
        self._holding = self._holding or bool(published)

    def _release_held(self) -> None:
        if self._holding:
            self._core.space.release_held()
            self._holding = False

    def _wrote(self, records: list[bytes]) -> None:
        if self._num_failing:
            log.warning("journal writes resume after %d failed ones (%d records caught up)",
                        self._num_failing, len(self._carry))
            self._num_failing, self.write_error = 0, None
        self._carry = []
        self._release_held()
        self._log_bytes += sum(len(r) for r in records)

    def _sync(self, now: float) -> None:
        try:
            self.store.sync()
        except JournalWriteError as exc:  # acknowledged already: counted, retried next time
            self.num_write_failures += 1
            self._failures.warn("journal fsync failed: %s", exc)
            return
        self._last_sync = now

    def stats(self) -> JournalStats:
        return JournalStats(self.store.report, self.num_write_failures, len(self._carry),
                            self.write_error)

    def compact(self, core: CoreApi) -> None:
        """Snapshot the live tables and start a new log."""
        self.commit()  # first, so the snapshot holds no put a failed write takes back
        records = [SegRec(s.segment_id, s.client_id, s.endpoint, s.base_addr, s.capacity,
                          int(s.tier), s.fence).record() for s in core.segments.values()]
        records += [ObjRec(o.key, o.size, tuple((r.segment.segment_id, r.offset)
                                                for r in o.replicas),
                           o.checksum, o.hard_pinned).record() for o in core.objects.values()]
        self._rotate(records)
        log.info("state %s compacted: %d records", self.store.where(), len(records))

    def close(self) -> None:
        if self._open:
            self.commit()
            self._open = False
            self.store.close()


class PersistentService(MasterService):
    """A MasterService whose replies leave only after the records they acknowledge are
    in the log. With HA (`journal.fence` set) a master that no longer leads answers every
    request with an error, so nothing it says after losing its lease is acknowledged."""

    def __init__(self, core: MasterCore, journal: Journal, *args: Any, **kwargs: Any) -> None:
        super().__init__(core, *args, **kwargs)
        self.journal = journal

    def handle(self, frame: bytes) -> bytes:
        fence = self.journal.fence
        if fence is not None and not fence():
            return _not_leader(frame)
        reply = super().handle(frame)
        if self.journal.commit():
            return reply
        error = self.journal.write_error
        return _not_leader(frame) if error is None else _not_journaled(frame, error)


def _not_journaled(frame: bytes, error: str) -> bytes:
    """RPC_FAIL: the records of the request could not be written; what it put is not
    stored, and it may be sent again."""
    return encode_reply(peek_req_id(frame), int(ErrorCode.RPC_FAIL),
                        f"the master could not journal this request ({error}); nothing it "
                        "put is stored")


def _warn_damage(where: str, report: ReplayReport) -> None:
    if report.corrupt or report.problems:
        log.warning("state %s: replay skipped %d corrupt runs (%d bytes) and %d records it "
                    "could not apply, kept %d records: %s", where, report.num_corrupt_runs,
                    report.corrupt_bytes, report.num_bad_records, report.num_records,
                    "; ".join(report.problems))


def _not_leader(frame: bytes) -> bytes:
    """RPC_FAIL: the request was not served and may be sent again (to the leader etcd names
    by then); nothing in it was acknowledged."""
    return encode_reply(peek_req_id(frame), int(ErrorCode.RPC_FAIL),
                        "this master is not the leader (its lease lapsed); ask etcd again")
