"""Where the master's journal lives when it is a directory: a snapshot plus append-only logs.

    STATE_DIR/snapshot      H record, then S and P records: the state when it was written
    STATE_DIR/log.<seq>     records appended since (seq >= the snapshot's next_log_seq)

`load` replays the snapshot and every newer log (replay.py: a torn tail of the last log is
dropped, a damaged run elsewhere is skipped and counted, a missing or damaged snapshot that
the logs depend on stops the load with StateDamaged unless `recover_partial`). `rotate`
writes a new snapshot (tmp file, fsync), creates log.<seq + 1>, renames the snapshot into
place, fsyncs the directory and deletes the logs it replaces.

A failed append (ENOSPC, EIO; with `fsync_appends`, its fsync included) truncates the log
back to where that append began before it raises JournalWriteError, so the records written
after the disk has room again are not swallowed by a partial one at replay. A failed `sync`
(the 'interval' policy) raises and cuts nothing: the records it covers were acknowledged
already and stay in the file for a process crash to find.

Several HA masters may share the directory; only the leader writes, and a snapshot written
by a later term stops an older one (`StoreError`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NoReturn

from kvpool.errors import JournalWriteError, StateDamaged, StoreError
from kvpool.log import get_logger
from kvpool.metadata.durable import fsync_dir
from kvpool.store.master.records import DurableState, decode_frames, encode_record
from kvpool.store.master.replay import ReplayReport, replay_frames, snapshot_problem

log = get_logger("store.persist")
SNAPSHOT = "snapshot"
__all__ = ["FileLogStore", "load_state", "replay_frames"]


def _log_seq(path: Path) -> int | None:
    prefix, _, seq = path.name.partition(".")
    return int(seq) if prefix == "log" and seq.isdigit() else None


def _logs(state_dir: Path) -> list[tuple[int, Path]]:
    """(seq, path) of every log file, oldest first."""
    found = ((_log_seq(p), p) for p in state_dir.iterdir())
    return sorted((seq, p) for seq, p in found if seq is not None)


def load_state(state_dir: Path, recover_partial: bool = False,
               report: ReplayReport | None = None) -> tuple[DurableState, list[Path]]:
    """The state in `state_dir` and the log files it was read from; what was skipped goes
    into `report`. StateDamaged when the snapshot the logs depend on is missing or damaged,
    unless `recover_partial` (then what is left is loaded, with a warning)."""
    report = report if report is not None else ReplayReport()
    state = DurableState()
    snap = state_dir / SNAPSHOT
    data = snap.read_bytes() if snap.exists() else b""
    scan = replay_frames(state, data, str(snap), report, last=False) if snap.exists() \
        else None
    logs = _logs(state_dir)
    problem = snapshot_problem(data, scan, state, [seq for seq, _ in logs])
    if problem is not None:
        _damaged(f"{snap} {problem}", recover_partial, report)
    live = [(seq, path) for seq, path in logs if seq >= state.next_log_seq]
    for i, (_, path) in enumerate(live):
        replay_frames(state, path.read_bytes(), str(path), report, last=i == len(live) - 1)
    if logs:
        state.next_log_seq = max(state.next_log_seq, logs[-1][0] + 1)
    state.drop_orphans()
    return state, [path for _, path in logs]


def _damaged(problem: str, recover_partial: bool, report: ReplayReport) -> None:
    if not recover_partial:
        raise StateDamaged(f"{problem}; starting on it would serve only part of the stored "
                           "objects. Restore the snapshot, or start with --recover-partial "
                           "to keep what the remaining files hold")
    report.add_problem(problem, "loading what is left (--recover-partial)")


class FileLogStore:
    """The journal's storage in a directory (see the module docstring)."""

    def __init__(self, state_dir: str, recover_partial: bool = False,
                 fsync_appends: bool = False) -> None:
        """`fsync_appends`: each append is fsynced before it returns (the 'always' policy);
        otherwise appends reach the page cache and `sync` makes them durable."""
        self.durable_on_append = fsync_appends
        self.dir = Path(state_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.recover_partial = recover_partial
        self.report = ReplayReport()
        """What the last `load` skipped."""
        self._fd = -1
        self._seq = 0
        self._old_logs: list[Path] = []
        self._size = 0
        """End of the last record written whole to the current log."""
        self._dirty = False
        """A failed write left bytes after `_size` that a truncate has not removed yet."""

    def where(self) -> str:
        return str(self.dir)

    def load(self) -> DurableState:
        self.report = ReplayReport()
        state, self._old_logs = load_state(self.dir, self.recover_partial, self.report)
        for leftover in self.dir.glob(SNAPSHOT + ".tmp*"):  # of a crash, or a deposed leader
            leftover.unlink(missing_ok=True)
        self._seq = state.next_log_seq
        return state

    def rotate(self, records: list[bytes], term: int) -> None:
        """Make `records` (encoded) the state and start an empty log. JournalWriteError
        when the disk refuses (the previous snapshot and log then stay in use)."""
        seq = self._seq + 1
        tmp = self.dir / f"{SNAPSHOT}.tmp.{term}"  # two terms never share a tmp file
        current = self.dir / f"log.{seq}"
        try:
            _write_snapshot(tmp, [encode_record(["H", seq, term, len(records)]), *records])
            if self._snapshot_term() > term:
                raise StoreError(f"{self.dir}: a master of a later term wrote the snapshot; "
                                 f"this one (term {term}) must stop writing")
            fd = os.open(current, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o600)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise JournalWriteError(f"{self.dir}: cannot write a snapshot ({exc}); the "
                                    "previous one stays in use") from exc
        except StoreError:
            tmp.unlink(missing_ok=True)
            raise
        self._switch(tmp, fd, current, seq)

    def _switch(self, tmp: Path, fd: int, current: Path, seq: int) -> None:
        """Put the new snapshot in place and make `fd` (log.<seq>, empty) the log."""
        os.replace(tmp, self.dir / SNAPSHOT)
        if self._fd >= 0:
            os.close(self._fd)
        self._fd, self._seq, self._size, self._dirty = fd, seq, 0, False
        fsync_dir(self.dir)
        for path in self._old_logs:
            if path != current:
                path.unlink(missing_ok=True)
        self._old_logs = [current]

    def _snapshot_term(self) -> int:
        """The term in the current snapshot's header (0 when none)."""
        try:
            with open(self.dir / SNAPSHOT, "rb") as f:
                head = f.read(256)
        except FileNotFoundError:
            return 0
        records, _ = decode_frames(head)
        return int(records[0][2]) if records and records[0][0] == "H" else 0

    def append(self, records: list[bytes]) -> bool:
        """Write encoded `records` at the end of the log; False when the store is closed.
        JournalWriteError when the disk refuses: the log is then back at its previous end
        (or is truncated there before the next append)."""
        if self._fd < 0:
            return False
        data = b"".join(records)
        try:
            if self._dirty:
                self._truncate(self._size)
            _write_all(self._fd, data)
            if self.durable_on_append:
                os.fsync(self._fd)
        except OSError as exc:
            self._restore(self._size, exc)
        self._size += len(data)
        return True

    def sync(self) -> None:
        """Make the appended records durable; JournalWriteError when that fails."""
        if self._fd < 0:
            return
        try:
            os.fsync(self._fd)
        except OSError as exc:
            raise JournalWriteError(f"{self.dir}/log.{self._seq}: fsync failed ({exc})") \
                from exc

    def _restore(self, offset: int, exc: OSError) -> NoReturn:
        """Cut the log back to the record boundary `offset`, then raise."""
        self._dirty = True
        try:
            self._truncate(offset)
        except OSError:
            pass  # retried before the next append
        where = "could not be cut back to byte" if self._dirty else "is cut back to byte"
        raise JournalWriteError(f"{self.dir}/log.{self._seq}: write failed ({exc}); nothing "
                                f"of it is acknowledged, the log {where} {offset}",
                                may_have_landed=self._dirty) from exc

    def _truncate(self, offset: int) -> None:
        os.ftruncate(self._fd, offset)
        os.fsync(self._fd)
        self._dirty = False

    def close(self) -> None:
        if self._fd >= 0:
            try:
                self.sync()
            finally:
                os.close(self._fd)
                self._fd = -1


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _write_snapshot(path: Path, records: list[bytes]) -> None:
    with open(path, "wb") as f:
        f.write(b"".join(records))
        f.flush()
        os.fsync(f.fileno())
