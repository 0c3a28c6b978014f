"""Content digests of weight files (safetensors shards, GGUF files), cached beside them.

A digest is blake2b-256 over the file's bytes, read CHUNK_BYTES at a time. Hashing gigabytes
takes seconds, so each folder keeps its files' digests in CACHE_NAME:

    {"version": 1, "files": {"model.safetensors": {"size": 1234, "mtime_ns": 1700..., "blake2b": "9f.."}}}

An entry is used only while the file's size and mtime_ns are the ones it records; otherwise
the file is hashed again. The cache is written to a temporary file and renamed, so a reader
never sees half of one; where the folder is read-only the digests are computed and not kept
(logged once per folder). Two processes hashing at once both write; the last rename wins and
loses nothing that the other would not recompute. A file changed while it is hashed is not
cached (its stat before and after differ).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpool.log import get_logger

CACHE_NAME = ".kvpool-weights-digest.json"
CACHE_VERSION = 1
CHUNK_BYTES = 4 << 20
"""Bytes read per update: large enough that hashing runs at the digest's speed."""

LOUD_BYTES = 256 << 20
"""Hashing a file this large is logged: it explains a slow first start."""

log = get_logger(__name__)
_warned: set[Path] = set()
"""Folders whose read-only cache was already logged."""


def hash_file(path: Path) -> str:
    """blake2b-256 hex digest of the file's contents, read in CHUNK_BYTES pieces."""
    h = hashlib.blake2b(digest_size=32, person=b"kvpool-weights")
    buf = bytearray(CHUNK_BYTES)
    view = memoryview(buf)
    with path.open("rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


@dataclass(frozen=True)
class FileStamp:
    """What says a file is unchanged since its digest was taken."""

    size: int
    mtime_ns: int

    @classmethod
    def of(cls, path: Path) -> FileStamp:
        st = path.stat()
        return cls(st.st_size, st.st_mtime_ns)


def file_digests(folder: Path, names: Sequence[str],
                 hasher: Callable[[Path], str] | None = None) -> dict[str, str]:
    """name -> content digest of each file `names` lists in `folder`, from the folder's cache
    where the file is unchanged, else hashed by `hasher` (default `hash_file`), and the cache
    updated when the folder allows. Raises OSError when a file cannot be read."""
    hasher = hasher or hash_file
    cached = _read_cache(folder / CACHE_NAME)
    out: dict[str, str] = {}
    keep: dict[str, dict[str, Any]] = {}
    for name in sorted(names):
        stamp = FileStamp.of(folder / name)
        entry = cached.get(name)
        if entry is not None and _matches(entry, stamp):
            out[name], keep[name] = entry["blake2b"], entry
            continue
        if stamp.size >= LOUD_BYTES:
            log.info("hashing %s (%.1f GB) for the model's KV identity", folder / name,
                     stamp.size / 1e9)
        out[name] = hasher(folder / name)
        if FileStamp.of(folder / name) == stamp:
            keep[name] = {"size": stamp.size, "mtime_ns": stamp.mtime_ns, "blake2b": out[name]}
    if keep != {n: cached[n] for n in names if n in cached}:
        others = {n: e for n, e in cached.items() if n not in out and (folder / n).is_file()}
        _write_cache(folder, keep | others)  # others: a GGUF file's neighbours
    return out


def _matches(entry: dict[str, Any], stamp: FileStamp) -> bool:
    return (entry.get("size") == stamp.size and entry.get("mtime_ns") == stamp.mtime_ns
            and isinstance(entry.get("blake2b"), str))


def _read_cache(path: Path) -> dict[str, dict[str, Any]]:
    """The cache's entries; none when it is missing, unreadable or of another version."""
    try:
        obj = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(obj, dict) or obj.get("version") != CACHE_VERSION:
        return {}
    files = obj.get("files")
    if not isinstance(files, dict):
        return {}
    return {k: v for k, v in files.items() if isinstance(v, dict)}


def _write_cache(folder: Path, entries: dict[str, dict[str, Any]]) -> None:
    """Replace the folder's cache atomically; a folder that refuses is logged once."""
    tmp = folder / f"{CACHE_NAME}.tmp{os.getpid()}"
    try:
        tmp.write_text(json.dumps({"version": CACHE_VERSION, "files": entries},
                                  sort_keys=True, indent=1) + "\n")
        os.replace(tmp, folder / CACHE_NAME)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        if folder not in _warned:
            _warned.add(folder)
            log.info("weights digests of %s are not cached (%s); they are computed at each "
                     "start", folder, exc)
