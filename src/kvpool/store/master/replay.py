"""Replaying the journal's bytes into a DurableState, and what the replay had to skip.

Sans-I/O: the stores (log_files.py, log_etcd.py) read the bytes; this module applies them
and keeps count. Three kinds of damage, told apart by `records.scan_frames`:

- **torn tail**: bytes after the last intact frame of the LAST log, the record a crash cut
  short. Expected; dropped with a warning.
- **corruption**: a damaged run with intact frames after it (a flipped byte, a bad sector),
  or a cut tail anywhere but the end of the last log. Only the damaged frames are lost:
  replay resynchronises on the next intact frame and goes on; counted and logged.
- **a damaged snapshot**: missing, empty, cut or corrupt while the logs depend on it (see
  `snapshot_problem`). Loading then refuses (StateDamaged) unless told to recover what is
  left.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpool.errors import RemoteProtocolError
from kvpool.log import get_logger
from kvpool.store.master.records import DurableState, FrameScan, scan_frames

log = get_logger("store.persist")
FIRST_LOG_SEQ = 1
"""The seq of the first log of a new state directory; its snapshot holds nothing, so that
log replays without it."""


@dataclass
class ReplayReport:
    """What one load read and skipped, over every file (or etcd value) it replayed."""

    num_records: int = 0
    num_corrupt_runs: int = 0
    """Damaged runs skipped in the middle of a file (replay went on after each)."""
    corrupt_bytes: int = 0
    torn_tail_bytes: int = 0
    """Bytes dropped from the end of the last log (a write a crash cut short)."""
    num_bad_records: int = 0
    """Intact frames this version cannot apply (replay of that file stopped there)."""
    problems: list[str] = field(default_factory=list)
    """One line per damaged file, for the log and the admin page."""

    @property
    def corrupt(self) -> bool:
        return bool(self.num_corrupt_runs or self.num_bad_records)

    def as_dict(self) -> dict[str, object]:
        return {"records": self.num_records, "corrupt_runs": self.num_corrupt_runs,
                "corrupt_bytes": self.corrupt_bytes, "torn_tail_bytes": self.torn_tail_bytes,
                "bad_records": self.num_bad_records, "problems": list(self.problems)}

    def note(self, where: str, scan: FrameScan, last: bool) -> None:
        """Count one scan; `last`: it is the end of the last log (a tail there is torn)."""
        self.num_records += len(scan.records)
        runs = len(scan.skipped) + (0 if last or not scan.tail_bytes else 1)
        bad = scan.skipped_bytes + (0 if last else scan.tail_bytes)
        if runs:
            self.num_corrupt_runs += runs
            self.corrupt_bytes += bad
            self.add_problem(where, f"skipped {runs} corrupt runs ({bad} bytes) among "
                                 f"{len(scan.records)} intact records")
        if last and scan.tail_bytes:
            self.torn_tail_bytes += scan.tail_bytes
            log.warning("%s: dropped a torn tail of %d bytes after %d records", where,
                        scan.tail_bytes, len(scan.records))

    def add_problem(self, where: str, what: str) -> None:
        self.problems.append(f"{where}: {what}")
        log.warning("%s: %s", where, what)


@dataclass(frozen=True)
class JournalStats:
    """A running journal's health, for metrics and the admin page."""

    replay: ReplayReport
    """What the load at start skipped."""
    num_write_failures: int
    """Appends that failed since start (their requests were answered RPC_FAIL), and
    fsyncs of the 'interval' policy that failed."""
    num_carried_records: int
    """Records of failed writes still waiting to be written."""
    write_error: str | None
    """Why the last write failed, while no write has succeeded since."""

    def as_dict(self) -> dict[str, object]:
        return {"replay": self.replay.as_dict(), "write_failures": self.num_write_failures,
                "carried_records": self.num_carried_records, "write_error": self.write_error}


def replay_frames(state: DurableState, data: bytes, where: str,
                  report: ReplayReport | None = None, last: bool = True) -> FrameScan:
    """Apply every intact record of `data` to `state`, skipping damaged runs (counted in
    `report`); a checksummed record this code cannot apply ends the replay of `data`."""
    scan = scan_frames(data)
    report = report if report is not None else ReplayReport()
    for i, payload in enumerate(scan.records):
        try:
            state.apply(payload)
        except RemoteProtocolError as exc:
            report.num_bad_records += 1
            report.add_problem(where, f"stopping replay at record {i} of "
                                   f"{len(scan.records)}: {exc}")
            break
    report.note(where, scan, last)
    return scan


def snapshot_problem(snapshot: bytes, scan: FrameScan | None, state: DurableState,
                     log_seqs: list[int]) -> str | None:
    """Why a snapshot (its bytes, their scan, the state after replaying it) cannot be the
    base of the logs `log_seqs`; None when it can. A snapshot is written whole (tmp file,
    fsync, rename), so any damage in it is lost state, never a torn write."""
    later = [s for s in log_seqs if s > FIRST_LOG_SEQ]
    if scan is None or not scan.records:
        if not later:
            return None
        what = "is missing" if scan is None else "is empty" if not snapshot else \
            "has no intact record"
        return f"{what}, but log.{later[0]} needs it (it holds the state before that log)"
    if scan.records[0][0] != "H":
        return "does not start with its header record"
    if scan.skipped or scan.tail_bytes:
        return f"is damaged ({scan.skipped_bytes + scan.tail_bytes} bytes unreadable)"
    if state.num_records is not None and len(scan.records) - 1 != state.num_records:
        return f"holds {len(scan.records) - 1} of the {state.num_records} records its " \
               "header promises (it was cut)"
    return None
