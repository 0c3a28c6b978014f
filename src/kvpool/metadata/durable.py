"""A MemoryBackend that survives restarts: every change is appended to a state file (see
journal.py for the frame format) and fsynced before the call that made it returns.

Opening replays the file up to its first torn or corrupt frame, then rewrites the survivors
as a fresh file (written to PATH.tmp, fsynced, renamed over PATH, directory fsynced), so a
crash at any instant leaves either the old file or the new one, never a mix. The file is
compacted the same way at run time once it holds more than `compact_factor` times the live
data (plus 1 MiB).
"""

from __future__ import annotations

import os
from pathlib import Path

from kvpool.errors import MetadataError
from kvpool.log import get_logger
from kvpool.metadata.journal import (
    DeleteRecord,
    PutRecord,
    Record,
    decode_frames,
    encode_frame,
    replay,
)
from kvpool.metadata.memory import MemoryBackend

_log = get_logger("metadata.durable")
COMPACT_SLACK_BYTES = 1 << 20


class DurableBackend(MemoryBackend):
    """Thread-safe like MemoryBackend; `put`/`delete` raise MetadataError when the state
    file cannot be written (the change is then not made)."""

    writes_block = True

    def __init__(self, path: str | os.PathLike[str], fsync: bool = True,
                 compact_factor: float = 2.0) -> None:
        super().__init__()
        self.path = Path(path)
        self.fsync = fsync
        self.compact_factor = compact_factor
        self._items = load_state(self.path)
        self._total_bytes = sum(len(v) for v in self._items.values())
        self._file_bytes = 0
        self._fd = -1
        with self._write_lock:
            self._rewrite()
        _log.info("metadata state %s: %d keys restored", self.path, len(self._items))

    def _journal_put(self, key: str, value: bytes) -> None:
        self._append(PutRecord(key, value))

    def _journal_delete(self, key: str) -> None:
        self._append(DeleteRecord(key))

    def _append(self, record: Record) -> None:
        """Log one change (under the write lock, before it is made); first compact the file when
        it has grown well past the live data."""
        if self._file_bytes > self.compact_factor * self._total_bytes + COMPACT_SLACK_BYTES:
            self._rewrite()
        frame = memoryview(encode_frame(record))
        try:
            done = 0
            while done < len(frame):
                done += os.write(self._fd, frame[done:])
            if self.fsync:
                os.fsync(self._fd)
        except OSError as exc:
            _truncate(self._fd, self._file_bytes)   # no half frame before the next one
            raise MetadataError(f"cannot write metadata state file {self.path}: {exc}") from exc
        self._file_bytes += len(frame)

    def _rewrite(self) -> None:
        """Write the live items as a new state file and append to it from now on (under the
        write lock)."""
        data = b"".join(encode_frame(PutRecord(k, v)) for k, v in self._items.items())
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            write_durably(tmp, data)
            os.replace(tmp, self.path)
            fsync_dir(self.path.parent)
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        except OSError as exc:
            raise MetadataError(f"cannot write metadata state file {self.path}: {exc}") from exc
        if self._fd >= 0:
            os.close(self._fd)
        self._fd, self._file_bytes = fd, len(data)

    def _release(self) -> None:
        with self._write_lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


def _truncate(fd: int, size: int) -> None:
    try:
        os.ftruncate(fd, size)
    except OSError as exc:
        _log.error("cannot cut a failed write off the metadata state file: %s", exc)


def load_state(path: Path) -> dict[str, bytes]:
    """The items a state file holds (empty when it does not exist); a torn or corrupt tail is
    dropped with a warning."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise MetadataError(f"cannot read metadata state file {path}: {exc}") from exc
    records, good = decode_frames(data)
    if good < len(data):
        _log.warning("metadata state %s: dropped %d bytes after the last intact record "
                     "(a write cut off by a crash, or damage)", path, len(data) - good)
    return replay(records)


def write_durably(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
