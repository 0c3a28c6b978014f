"""A store node's disk tier: one file per object under a directory, each self-checking.

Mechanism only: the master decides what goes to disk, what leaves it and when (tasks, see
store/master/tiering.py); this class writes, reads, lists and deletes files, and refuses to
hand out a byte it cannot prove. File layout (little endian):

    0        8        10       12        16       24         32     40      48
    | magic  | version| flags  | key_len | size   | checksum | gen  | meta  | key ... | payload
                                                     xxh3_64    u64    xxh3_64 of bytes 0..40
                                                     of payload        and of the key

`meta` covers the header and the key, so a flipped bit in the key or the size is caught
before the payload is trusted; `checksum` is the object's xxh3_64, the same value readers
verify. `gen` names one offload (the master's generation), so a late DELETE or LOAD of an
older copy of the same key is told apart. With `fsync` a file is written under a temporary
name, flushed, renamed into place and the directory flushed, so a crash (even a power loss)
leaves either the old file, the new one, or a temporary (deleted at the next scan).
Without it (a cache) the file is written in place, one directory operation instead of
three (file creation is what limits small offloads): a crash can leave a torn file, which
the size and checksum checks catch.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass

import xxhash

from kvpool.log import get_logger

log = get_logger("store.ssd")

MAGIC = b"KVPSSD\x00\x01"
VERSION = 1
_HEAD = struct.Struct("<8sHHIQQQ")   # magic, version, flags, key_len, size, checksum, gen
_META = struct.Struct("<Q")
HEADER_BYTES = _HEAD.size + _META.size  # 48
SUFFIX = ".kv"
TMP_MARK = ".tmp"
CHUNK_BYTES = 8 << 20


@dataclass(frozen=True, slots=True)
class SsdEntry:
    """One object file that passed its checks."""

    key: str
    size: int
    checksum: int
    gen: int


@dataclass(frozen=True, slots=True)
class ScanResult:
    entries: list[SsdEntry]
    num_discarded: int
    """Torn, corrupt or temporary files deleted by the scan."""


def file_name(key: str) -> str:
    return xxhash.xxh3_128_hexdigest(key.encode()) + SUFFIX


def encode_header(key: str, size: int, checksum: int, gen: int) -> bytes:
    raw_key = key.encode()
    head = _HEAD.pack(MAGIC, VERSION, 0, len(raw_key), size, checksum, gen)
    return head + _META.pack(xxhash.xxh3_64_intdigest(head + raw_key)) + raw_key


class SsdStore:
    """The files of one node's disk tier. Not thread-safe: one worker drives it."""

    def __init__(self, root: str, fsync: bool = False) -> None:
        self.root = root
        self.fsync = fsync
        os.makedirs(root, exist_ok=True)
        self.entries: dict[str, SsdEntry] = {}
        self.num_discarded = 0

    def path(self, key: str) -> str:
        return os.path.join(self.root, file_name(key))

    def write(self, key: str, payload: memoryview, checksum: int, gen: int) -> SsdEntry:
        """Store `payload` as `key`'s file (replacing any older one). The caller has checked
        that `checksum` is the payload's xxh3_64. Raises OSError (disk full, I/O error);
        a failed write leaves no file of `key` (the older one is gone too)."""
        final = self.path(key)
        self.entries.pop(key, None)
        if self.fsync:  # survive power loss: the old file or the new one, whole
            tmp = f"{final}{TMP_MARK}{os.getpid()}"
            try:
                _write_file(tmp, encode_header(key, len(payload), checksum, gen), payload,
                            sync=True)
                os.replace(tmp, final)
            except BaseException:
                _unlink(tmp)
                raise
            self._sync_dir()
        else:  # in place (one directory operation): a torn file fails its checks
            try:
                _write_file(final, encode_header(key, len(payload), checksum, gen), payload,
                            sync=False)
            except BaseException:
                _unlink(final)
                raise
        entry = SsdEntry(key, len(payload), checksum, gen)
        self.entries[key] = entry
        return entry

    def read_into(self, key: str, gen: int, out: memoryview) -> bool:
        """Fill `out` with `key`'s payload of generation `gen` and verify it. False (and
        the file is deleted when it is bad) when the file is missing, of another
        generation, torn or corrupt: its bytes are then undefined and must not be used."""
        entry = self.entries.get(key)
        if entry is None or entry.gen != gen or entry.size != len(out):
            return False
        try:
            ok = self._read_verified(self.path(key), entry, out)
        except OSError as exc:
            log.warning("cannot read %s: %s", self.path(key), exc)
            ok = False
        if not ok:
            self.discard(key, "failed its check on read")
        return ok

    def delete(self, key: str, gen: int | None = None) -> bool:
        """Delete `key`'s file (only of generation `gen` when given); whether one was."""
        entry = self.entries.get(key)
        if entry is None or (gen is not None and entry.gen != gen):
            return False
        del self.entries[key]
        _unlink(self.path(key))
        return True

    def discard(self, key: str, why: str) -> None:
        log.warning("discarding the disk copy of %r: %s", key, why)
        self.entries.pop(key, None)
        _unlink(self.path(key))
        self.num_discarded += 1

    def scan(self) -> ScanResult:
        """Forget what is known, then list the directory: every file that passes its checks
        becomes an entry; temporary, torn and corrupt files are deleted."""
        self.entries.clear()
        discarded = 0
        for name in sorted(os.listdir(self.root)):
            if not _ours(name):
                continue  # the lock file, or anything else that is not ours
            entry = None if TMP_MARK in name else self._check_file(name)
            if entry is None:
                discarded += 1
                _unlink(os.path.join(self.root, name))
            else:
                self.entries[entry.key] = entry
        self.num_discarded += discarded
        return ScanResult(list(self.entries.values()), discarded)

    @property
    def used_bytes(self) -> int:
        return sum(e.size for e in self.entries.values())

    def check_integrity(self) -> None:
        """AssertionError unless every entry has its file, of the right length."""
        for key, entry in self.entries.items():
            path = self.path(key)
            want = HEADER_BYTES + len(key.encode()) + entry.size
            assert os.path.getsize(path) == want, f"{path}: length != {want}"

    # -- internals ---------------------------------------------------------------------

    def _check_file(self, name: str) -> SsdEntry | None:
        path = os.path.join(self.root, name)
        try:
            entry = self._read_header(path)
            if entry is None or file_name(entry.key) != name:
                return None
            out = memoryview(bytearray(entry.size))
            return entry if self._read_verified(path, entry, out) else None
        except OSError as exc:
            log.warning("cannot read %s: %s", path, exc)
            return None

    @staticmethod
    def _read_header(path: str) -> SsdEntry | None:
        with open(path, "rb") as f:
            head = f.read(HEADER_BYTES)
            if len(head) != HEADER_BYTES:
                return None
            magic, version, _, key_len, size, checksum, gen = _HEAD.unpack_from(head)
            if magic != MAGIC or version != VERSION or not 0 < key_len <= 1 << 16:
                return None
            raw_key = f.read(key_len)
        (meta,) = _META.unpack_from(head, _HEAD.size)
        if len(raw_key) != key_len or \
                xxhash.xxh3_64_intdigest(head[:_HEAD.size] + raw_key) != meta:
            return None
        try:
            return SsdEntry(raw_key.decode(), size, checksum, gen)
        except UnicodeDecodeError:
            return None

    @staticmethod
    def _read_verified(path: str, entry: SsdEntry, out: memoryview) -> bool:
        offset = HEADER_BYTES + len(entry.key.encode())
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size != offset + entry.size:
                return False
            f.seek(offset)
            got = 0
            for chunk in _chunks(out):
                n = f.readinto(chunk)
                got += n
                if n != len(chunk):
                    return False
        return got == entry.size and xxhash.xxh3_64_intdigest(out) == entry.checksum

    def _sync_dir(self) -> None:
        fd = os.open(self.root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _write_file(path: str, header: bytes, payload: memoryview, sync: bool) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        done = os.writev(fd, [header, payload])
        want = len(header) + len(payload)
        while done < want:  # short writes: rare, but allowed
            done += os.write(fd, (header + bytes(payload))[done:])
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


def _chunks(view: memoryview) -> Iterator[memoryview]:
    for lo in range(0, len(view), CHUNK_BYTES):
        yield view[lo:lo + CHUNK_BYTES]


def _ours(name: str) -> bool:
    """An object file or a temporary one (`<hex>.kv` or `<hex>.kv.tmp<pid>`)."""
    return name.endswith(SUFFIX) or (SUFFIX + TMP_MARK) in name


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
