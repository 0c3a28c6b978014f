"""Single-master persistence: a snapshot plus an append-only log in a state directory.

    STATE_DIR/snapshot      H record, then S and P records: the state when it was written
    STATE_DIR/log.<seq>     records appended since (seq >= the snapshot's next_log_seq)

Opening a directory replays the snapshot and every newer log (a torn tail, detected by the
frame checksum, is dropped with a warning), writes the result as a new snapshot (tmp file,
fsync, rename, fsync of the directory), deletes the replayed logs and starts log.<next>.
Compaction at run time does the same from the live tables once the log passes
`compact_bytes` (under the master's lock; no request is served meanwhile).

What is acknowledged is durable: the service writes the records a request produced to the
log before its reply leaves (`PersistentService`); `fsync` says when they reach the disk:
"always" before each reply (survives a machine crash), "interval" every fsync_interval_s
(a process crash loses nothing, a power loss up to that interval), "never" (the OS decides).

A restarted master knows its objects but not their memory's owners: each recovered segment
waits for its node to mount again (same client id, endpoint, base address and size; the
node brings a new fence, which the objects then carry). Only then are its objects served.
Segments not back within `recovery_grace_s` are dropped with their objects.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvpool.errors import ConfigError, RemoteProtocolError, StoreError
from kvpool.log import get_logger
from kvpool.store.master.records import (
    DurableState,
    ObjRec,
    SegRec,
    decode_frames,
    encode_record,
)
from kvpool.store.master.service import INTERNAL_ERROR, MasterService
from kvpool.store.master.state import Replica, Segment, StoredObject
from kvpool.store.wire.protocol import encode_reply, peek_req_id

if TYPE_CHECKING:
    from kvpool.store.master.core import MasterCore

log = get_logger("store.persist")
FSYNC_POLICIES = ("always", "interval", "never")
SNAPSHOT = "snapshot"


@dataclass(frozen=True)
class PersistConfig:
    state_dir: str
    """Directory of the snapshot and log (created if missing)."""
    fsync: str = "always"
    """'always' (before each reply), 'interval' or 'never' (see the module docstring)."""
    fsync_interval_s: float = 1.0
    compact_bytes: int = 64 << 20
    """Log size that triggers a snapshot of the live tables."""
    recovery_grace_s: float = 30.0
    """How long recovered segments wait for their nodes to mount again."""

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


def _log_seq(path: Path) -> int | None:
    prefix, _, seq = path.name.partition(".")
    return int(seq) if prefix == "log" and seq.isdigit() else None


def _replay_file(state: DurableState, path: Path) -> None:
    data = path.read_bytes()
    records, used = decode_frames(data)
    for payload in records:
        try:
            state.apply(payload)
        except RemoteProtocolError as exc:
            log.warning("%s: stopping replay at a bad record: %s", path, exc)
            return
    if used != len(data):
        log.warning("%s: dropped a torn tail of %d bytes after %d records", path,
                    len(data) - used, len(records))


def load_state(state_dir: Path) -> tuple[DurableState, list[Path]]:
    """The state in `state_dir` and the log files it was read from."""
    state = DurableState()
    snap = state_dir / SNAPSHOT
    if snap.exists():
        _replay_file(state, snap)
    logs = sorted((p for p in state_dir.iterdir() if _log_seq(p) is not None),
                  key=lambda p: _log_seq(p) or 0)
    replayed = []
    for path in logs:
        seq = _log_seq(path) or 0
        if seq >= state.next_log_seq:
            _replay_file(state, path)
        replayed.append(path)
    if logs:
        state.next_log_seq = max(state.next_log_seq, (_log_seq(logs[-1]) or 0) + 1)
    state.drop_orphans()
    return state, replayed


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Journal:
    """The log writer and recovery of one master; the core calls its `on_*` hooks."""

    def __init__(self, config: PersistConfig, core: MasterCore, term: int = 0) -> None:
        self.config = config
        self.dir = Path(config.state_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        state, replayed = load_state(self.dir)
        for leftover in self.dir.glob(SNAPSHOT + ".tmp*"):  # of a crash, or a deposed leader
            leftover.unlink(missing_ok=True)
        log.info("state %s: %d segments and %d objects recovered", self.dir,
                 len(state.segments), len(state.objects))
        self.recovery = Recovery(state, core.clock.now() + config.recovery_grace_s)
        self.term = term or state.term  # a single master keeps the term it found
        self._seq = state.next_log_seq
        self._fd = -1
        self._buf: list[bytes] = []
        self._log_bytes = 0
        self._last_sync = core.clock.now()
        self.fence: Callable[[], bool] | None = None
        """With HA: whether this master still leads; records are written only then."""
        self._rotate(state.records(), replayed)

    def _rotate(self, records: list[list[Any]], old_logs: list[Path]) -> None:
        """Write `records` as the snapshot, start log.<seq + 1>, delete `old_logs`."""
        self.commit()
        self._seq += 1
        tmp = self.dir / f"{SNAPSHOT}.tmp.{self.term}"  # two terms never share a tmp file
        with open(tmp, "wb") as f:
            f.write(encode_record(["H", self._seq, self.term]))
            f.write(b"".join(encode_record(r) for r in records))
            f.flush()
            os.fsync(f.fileno())
        if self._newer_snapshot_term() > self.term:
            tmp.unlink(missing_ok=True)
            raise StoreError(f"{self.dir}: a master of a later term wrote the snapshot; this "
                             f"one (term {self.term}) must stop writing")
        os.replace(tmp, self.dir / SNAPSHOT)
        if self._fd >= 0:
            os.close(self._fd)
        self._fd = os.open(self.dir / f"log.{self._seq}",
                           os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o600)
        _fsync_dir(self.dir)
        for path in old_logs:
            path.unlink(missing_ok=True)
        self._log_bytes = 0

    def _newer_snapshot_term(self) -> int:
        """The term in the current snapshot's header (0 when none)."""
        try:
            with open(self.dir / SNAPSHOT, "rb") as f:
                head = f.read(256)
        except FileNotFoundError:
            return 0
        records, _ = decode_frames(head)
        return int(records[0][2]) if records and records[0][0] == "H" else 0

    # -- hooks called by the core (under the master's lock) ------------------------------

    def on_mount(self, core: MasterCore, seg: Segment) -> None:
        if not self.recovery.matches(seg):
            if self.recovery.give_up(seg.segment_id):
                self._append(["D", seg.segment_id])
        self._append(SegRec(seg.segment_id, seg.client_id, seg.endpoint, seg.base_addr,
                            seg.capacity, int(seg.tier), seg.fence).record())
        for key in self.recovery.reattach(core, seg):
            self._append(["R", key])

    def on_drop(self, segment_id: str) -> None:
        self._append(["D", segment_id])

    def on_put(self, obj: StoredObject) -> None:
        self._append(["P", obj.key, obj.size,
                      [[r.segment.segment_id, r.offset] for r in obj.replicas],
                      obj.checksum, obj.hard_pinned])

    def on_remove(self, key: str) -> None:
        self._append(["R", key])

    def remove_recovering(self, key: str) -> bool:
        """Remove an object whose segment has not come back yet; whether there was one
        (the core then answers OK instead of OBJECT_NOT_FOUND)."""
        if not self.recovery.forget(key):
            return False
        self._append(["R", key])
        return True

    def on_tick(self, core: MasterCore) -> None:
        if self.fence is not None and not self.fence():
            self._buf.clear()
            return
        for segment_id in self.recovery.expire(core.clock.now()):
            self._append(["D", segment_id])
        self.commit()
        now = core.clock.now()
        if self._fd >= 0 and self.config.fsync == "interval" and now - self._last_sync >= \
                self.config.fsync_interval_s:
            os.fsync(self._fd)
            self._last_sync = now
        if self._log_bytes > self.config.compact_bytes and self.recovery.done:
            self.compact(core)

    # -- writing ------------------------------------------------------------------------

    def _append(self, payload: list[Any]) -> None:
        self._buf.append(encode_record(payload))

    def commit(self) -> bool:
        """Write buffered records to the log (and fsync under the 'always' policy); False
        when they were dropped instead (this master no longer leads, or is closed)."""
        if not self._buf:
            return True
        if self._fd < 0 or (self.fence is not None and not self.fence()):
            self._buf.clear()
            return False
        data = b"".join(self._buf)
        self._buf.clear()
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view):]
        self._log_bytes += len(data)
        if self.config.fsync == "always":
            os.fsync(self._fd)
        return True

    def compact(self, core: MasterCore) -> None:
        """Snapshot the live tables and start a new log."""
        records = [SegRec(s.segment_id, s.client_id, s.endpoint, s.base_addr, s.capacity,
                          int(s.tier), s.fence).record() for s in core.segments.values()]
        records += [ObjRec(o.key, o.size, tuple((r.segment.segment_id, r.offset)
                                                for r in o.replicas),
                           o.checksum, o.hard_pinned).record() for o in core.objects.values()]
        self._rotate(records, [self.dir / f"log.{self._seq}"])
        log.info("state %s compacted: %d records", self.dir, len(records))

    def close(self) -> None:
        if self._fd >= 0:
            self.commit()
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd = -1


class Recovery:
    """Recovered segments waiting for their nodes, and their objects."""

    def __init__(self, state: DurableState, deadline: float) -> None:
        self.segments = dict(state.segments)
        self.deadline = deadline
        self._by_segment: dict[str, dict[str, ObjRec]] = {sid: {} for sid in self.segments}
        for obj in state.objects.values():
            for segment_id, _ in obj.replicas:
                self._by_segment[segment_id][obj.key] = obj
        self._attached: dict[str, StoredObject] = {}
        """Objects this recovery put back (later replicas join only those)."""

    @property
    def done(self) -> bool:
        return not self.segments

    def matches(self, seg: Segment) -> bool:
        rec = self.segments.get(seg.segment_id)
        return rec is not None and (rec.client_id, rec.endpoint, rec.base_addr, rec.size) \
            == (seg.client_id, seg.endpoint, seg.base_addr, seg.capacity)

    def give_up(self, segment_id: str) -> bool:
        self._by_segment.pop(segment_id, None)
        return self.segments.pop(segment_id, None) is not None

    def reattach(self, core: MasterCore, seg: Segment) -> list[str]:
        """Put back the objects of a recovered segment its node mounted again; returns the
        keys dropped instead (a put of the same key is in flight: the old value is gone)."""
        if not self.matches(seg):
            return []
        del self.segments[seg.segment_id]
        dropped = []
        attached = 0
        for rec in self._by_segment.pop(seg.segment_id, {}).values():
            offset = next(o for s, o in rec.replicas if s == seg.segment_id)
            obj = core.objects.get(rec.key)
            ours = self._attached.get(rec.key)
            if rec.key in core.pending and obj is None and ours is None:
                dropped.append(rec.key)
            elif ((obj is None and ours is None) or (obj is not None and ours is obj)) \
                    and seg.allocator.reserve(offset, rec.size):
                self._attach(core, seg, rec, offset, obj)
                attached += 1
        log.info("segment %s mounted again: %d objects back", seg.segment_id, attached)
        return dropped

    def _attach(self, core: MasterCore, seg: Segment, rec: ObjRec, offset: int,
                obj: StoredObject | None) -> None:
        replica = Replica(seg, offset, rec.size)
        if obj is None:
            obj = StoredObject(rec.key, rec.size, [replica], 0.0, rec.hard_pinned, 0.0,
                               rec.checksum)
            core.objects[rec.key] = self._attached[rec.key] = obj
            core.policy.on_insert(rec.key)
        else:
            obj.replicas.append(replica)
        seg.keys.add(rec.key)

    def forget(self, key: str) -> bool:
        """Drop a recovered object not yet back (a remove during recovery); whether it
        was one."""
        found = False
        for objects in self._by_segment.values():
            found = objects.pop(key, None) is not None or found
        return found

    def expire(self, now: float) -> list[str]:
        """Give up segments still missing at the deadline; their ids."""
        if not self.segments or now < self.deadline:
            return []
        gone = list(self.segments)
        for segment_id in gone:
            log.warning("segment %s did not come back within the grace period; dropping "
                        "its %d objects", segment_id, len(self._by_segment.get(segment_id, [])))
            self.give_up(segment_id)
        self._attached.clear()
        return gone


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
        return reply if self.journal.commit() else _not_leader(frame)


def _not_leader(frame: bytes) -> bytes:
    return encode_reply(peek_req_id(frame), INTERNAL_ERROR,
                        "this master is not the leader (its lease lapsed); ask etcd again")
