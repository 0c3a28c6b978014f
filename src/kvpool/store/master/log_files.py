"""Where the master's journal lives when it is a directory: a snapshot plus append-only logs.

    STATE_DIR/snapshot      H record, then S and P records: the state when it was written
    STATE_DIR/log.<seq>     records appended since (seq >= the snapshot's next_log_seq)

`load` replays the snapshot and every newer log (a torn tail, detected by the frame
checksum, is dropped with a warning). `rotate` writes a new snapshot (tmp file, fsync,
rename, fsync of the directory), starts log.<seq + 1> and deletes the logs it replaces.
Several HA masters may share the directory; only the leader writes, and a snapshot written
by a later term stops an older one (`StoreError`).
"""

from __future__ import annotations

import os
from pathlib import Path

from kvpool.errors import RemoteProtocolError, StoreError
from kvpool.log import get_logger
from kvpool.metadata.durable import fsync_dir
from kvpool.store.master.records import DurableState, decode_frames, encode_record

log = get_logger("store.persist")
SNAPSHOT = "snapshot"


def _log_seq(path: Path) -> int | None:
    prefix, _, seq = path.name.partition(".")
    return int(seq) if prefix == "log" and seq.isdigit() else None


def replay_frames(state: DurableState, data: bytes, where: str) -> None:
    """Apply every intact record of `data` to `state`; stop at a torn tail or a bad record."""
    records, used = decode_frames(data)
    for payload in records:
        try:
            state.apply(payload)
        except RemoteProtocolError as exc:
            log.warning("%s: stopping replay at a bad record: %s", where, exc)
            return
    if used != len(data):
        log.warning("%s: dropped a torn tail of %d bytes after %d records", where,
                    len(data) - used, len(records))


def load_state(state_dir: Path) -> tuple[DurableState, list[Path]]:
    """The state in `state_dir` and the log files it was read from."""
    state = DurableState()
    snap = state_dir / SNAPSHOT
    if snap.exists():
        replay_frames(state, snap.read_bytes(), str(snap))
    logs = sorted((p for p in state_dir.iterdir() if _log_seq(p) is not None),
                  key=lambda p: _log_seq(p) or 0)
    replayed = []
    for path in logs:
        seq = _log_seq(path) or 0
        if seq >= state.next_log_seq:
            replay_frames(state, path.read_bytes(), str(path))
        replayed.append(path)
    if logs:
        state.next_log_seq = max(state.next_log_seq, (_log_seq(logs[-1]) or 0) + 1)
    state.drop_orphans()
    return state, replayed


class FileLogStore:
    """The journal's storage in a directory (see the module docstring)."""

    durable_on_append = False
    """Appends reach the page cache; `sync` makes them durable."""

    def __init__(self, state_dir: str) -> None:
        self.dir = Path(state_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._fd = -1
        self._seq = 0
        self._old_logs: list[Path] = []

    def where(self) -> str:
        return str(self.dir)

    def load(self) -> DurableState:
        state, self._old_logs = load_state(self.dir)
        for leftover in self.dir.glob(SNAPSHOT + ".tmp*"):  # of a crash, or a deposed leader
            leftover.unlink(missing_ok=True)
        self._seq = state.next_log_seq
        return state

    def rotate(self, records: list[bytes], term: int) -> None:
        """Make `records` (encoded) the state and start an empty log."""
        self._seq += 1
        tmp = self.dir / f"{SNAPSHOT}.tmp.{term}"  # two terms never share a tmp file
        with open(tmp, "wb") as f:
            f.write(encode_record(["H", self._seq, term]))
            f.write(b"".join(records))
            f.flush()
            os.fsync(f.fileno())
        if self._snapshot_term() > term:
            tmp.unlink(missing_ok=True)
            raise StoreError(f"{self.dir}: a master of a later term wrote the snapshot; this "
                             f"one (term {term}) must stop writing")
        os.replace(tmp, self.dir / SNAPSHOT)
        if self._fd >= 0:
            os.close(self._fd)
        current = self.dir / f"log.{self._seq}"
        self._fd = os.open(current, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o600)
        fsync_dir(self.dir)
        for path in self._old_logs:
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
        """Write encoded `records` at the end of the log; False when the store is closed."""
        if self._fd < 0:
            return False
        view = memoryview(b"".join(records))
        while view:
            view = view[os.write(self._fd, view):]
        return True

    def sync(self) -> None:
        if self._fd >= 0:
            os.fsync(self._fd)

    def close(self) -> None:
        if self._fd >= 0:
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd = -1
