"""The shm transport: same-host peers' managed buffers, mapped from /dev/shm and copied directly.

Fences: before a copy into a peer's buffer the writer takes a shared `flock` on the buffer's
file, reads the fence word from the mapped header page and copies only if it admits the
request; the lock is held until the copy ends. The owner changes the word under an exclusive
lock (`SharedMemoryArena.fence_change`), so after its `set_fence` returns no copy checked
against the old fence is still running. Residual race: the lock is advisory, so a process of
our uid that maps the file without this protocol can still write it; and a read is checked
without the lock (a read never changes the target). Reads and writes into our own segment use
the in-process `Fence` of the target buffer instead.
"""

from __future__ import annotations

import fcntl
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import numpy as np

from kvpool.errors import KvpoolError
from kvpool.transfer.batch import Batch, OpCode
from kvpool.transfer.fence import READ_ADMITTED, admits
from kvpool.transfer.memory import FENCE_WORD, PeerMapping, lock_file, map_peer_shm
from kvpool.transfer.protocol import FENCED_REASON
from kvpool.transfer.segment import ProcessWatch, SegmentDescriptor

_NUMPY_COPY_BYTES = 64 << 10
_INLINE_BYTES = 256 << 10
SPLIT_BYTES = 2 << 20
"""Copies of at least this many bytes in all are shared by two threads: on the bench host
two threads copy 16 MiB to or from /dev/shm at 1.6-1.9x the rate of one (docs/perf.md)."""


class Guard(Protocol):
    """Admits a copy against a fence (`enter` -> token or None) and ends it (`leave`)."""

    def enter(self, fence: int, write: bool) -> int | None: ...

    def leave(self, token: int) -> None: ...


ShmItem = tuple[int, memoryview, memoryview, Guard, int]
"""(request index, local view, remote view, guard of the remote region, request fence)."""


def copy_bytes(dst: memoryview, src: memoryview) -> None:
    """memcpy; numpy for large copies since it releases the GIL."""
    if dst.nbytes >= _NUMPY_COPY_BYTES:
        np.copyto(np.frombuffer(dst, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8))
    else:
        dst[:] = src


def _copy_in_two(dst: memoryview, src: memoryview, helper: ThreadPoolExecutor) -> None:
    """copy_bytes, the second half (from a page boundary) on `helper`, the first here."""
    if dst.nbytes != src.nbytes:
        raise ValueError(f"copy of {src.nbytes} bytes into {dst.nbytes}")
    half = (dst.nbytes // 2) & ~4095
    second = helper.submit(copy_bytes, dst[half:], src[half:])
    try:
        copy_bytes(dst[:half], src[:half])
    finally:
        second.result()


class ShmGuard:
    """The fence of one mapped peer buffer: header word + shared file lock while copying.

    flock belongs to the open file, which every thread here shares, so the first writer in
    takes the lock and the last one out releases it.
    """

    def __init__(self, mapping: PeerMapping, name: str, timeout_s: float) -> None:
        self._mapping = mapping
        self._name = name
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._holders = 0

    def enter(self, fence: int, write: bool) -> int | None:
        if not write:
            return READ_ADMITTED if admits(int(self._mapping.words[FENCE_WORD]), fence) else None
        with self._lock:
            if self._holders == 0:
                lock_file(self._mapping.fd, fcntl.LOCK_SH, self._timeout_s, f"/dev/shm/{self._name}")
            self._holders += 1
        if admits(int(self._mapping.words[FENCE_WORD]), fence):
            return 1
        self.leave(1)
        return None

    def leave(self, token: int) -> None:
        if token == READ_ADMITTED:
            return
        with self._lock:
            self._holders -= 1
            if self._holders == 0:
                fcntl.flock(self._mapping.fd, fcntl.LOCK_UN)


Checked = dict[str, "tuple[PeerMapping, ShmGuard] | None"]
"""Region name -> its mapping as checked once for a batch (ShmPeer.resolve)."""


class ShmPeer:
    """The shared regions of one same-host peer, mapped on first use.

    A region whose file the peer has since unlinked (freed) or shrunk no longer resolves, so
    requests to it go over tcp and get the target's verdict instead of landing in orphaned
    memory (or faulting past the end of the file).
    """

    def __init__(self, descriptor: SegmentDescriptor, timeout_s: float = 10.0) -> None:
        self.descriptor = descriptor
        self.watch = ProcessWatch(descriptor.pid)
        self._timeout_s = timeout_s
        self._maps: dict[str, tuple[PeerMapping, ShmGuard]] = {}
        self._lock = threading.Lock()

    def resolve(self, addr: int, length: int, checked: Checked | None = None,
                ) -> tuple[memoryview, Guard] | None:
        """The mapped view of [addr, addr+length) and its guard, or None (not in a region,
        or the region's file is gone). `checked`, shared by the requests of one batch,
        remembers each region's mapping once it was checked, so a batch pays the check
        (an fstat) once per region instead of once per request."""
        for region in self.descriptor.shm_regions:
            if region.addr <= addr and addr + length <= region.addr + region.length:
                if checked is None:
                    entry = self._map(region.name, region.length)
                elif region.name in checked:
                    entry = checked[region.name]
                else:
                    entry = checked[region.name] = self._map(region.name, region.length)
                if entry is None:
                    return None
                start = addr - region.addr
                entry[0].chunks.prepare(start, length)
                return entry[0].view[start : start + length], entry[1]
        return None

    def _map(self, name: str, length: int) -> tuple[PeerMapping, ShmGuard] | None:
        with self._lock:
            entry = self._maps.get(name)
            if entry is None:
                try:
                    mapping = map_peer_shm(name, length, self.descriptor.pid)
                except OSError:
                    return None
                entry = self._maps[name] = (mapping, ShmGuard(mapping, name, self._timeout_s))
            info = os.fstat(entry[0].fd)
            if info.st_nlink == 0 or info.st_size < entry[0].size:  # freed or truncated since
                return None
            return entry

    def close(self) -> None:
        """Forget the mappings; each fd closes once no copy in flight still uses it."""
        with self._lock:
            self._maps = {}


class ShmTransport:
    """Runs copies inline when small, on a small thread pool when large."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvpool-shm")

    def run(self, op: OpCode, batch: Batch, items: list[ShmItem], peer: ShmPeer | None,
            inline: bool = False) -> None:
        """Small copies (all copies when `inline`) run in the caller's thread; large async
        ones on the pool. From SPLIT_BYTES on, the copies are cut in two halves by bytes,
        one of them on the pool (an `inline` caller copies the other, or the half of a lone
        request, itself)."""
        total = sum(item[1].nbytes for item in items)
        if total >= SPLIT_BYTES and len(items) > 1:
            first, second = _halves(items, total)
            self._pool.submit(_copy_all, op, batch, second, peer)
            items = first
        elif total >= SPLIT_BYTES and inline:
            _copy_all(op, batch, items, peer, self._pool)
            return
        if inline or total <= _INLINE_BYTES:
            _copy_all(op, batch, items, peer)
        else:
            self._pool.submit(_copy_all, op, batch, items, peer)

    @property
    def pool(self) -> ThreadPoolExecutor:
        """The copy threads; a caller's thread may hand them half of a large copy."""
        return self._pool

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _halves(items: list[ShmItem], total: int) -> tuple[list[ShmItem], list[ShmItem]]:
    """The items cut where the first part's bytes reach half the total (both non-empty)."""
    seen = 0
    for cut, item in enumerate(items[:-1], 1):
        seen += item[1].nbytes
        if 2 * seen >= total:
            return items[:cut], items[cut:]
    return items[:-1], items[-1:]


def _copy_all(op: OpCode, batch: Batch, items: list[ShmItem], peer: ShmPeer | None,
              helper: ThreadPoolExecutor | None = None) -> None:
    if peer is not None and not peer.watch.alive():
        batch.complete([item[0] for item in items],
                       f"peer process {peer.watch.pid} ({peer.descriptor.name}) is gone")
        return
    done: list[int] = []
    for item in items:
        if not batch.copy_started(item):  # given up: no byte of it may land any more
            batch.complete([item[0]], "the transfer was given up before this copy began")
            continue
        try:
            reason = copy_one(op, item, helper)
        finally:
            batch.frame_ended(item)
        if reason is None:
            done.append(item[0])
        else:
            batch.complete([item[0]], reason)
        if done and batch.on_done is not None:  # its hook reads the bytes while they are warm
            batch.complete(done, whole=True)
            done = []
    batch.complete(done, whole=True)


def copy_one(op: OpCode, item: ShmItem, helper: ThreadPoolExecutor | None = None) -> str | None:
    """Copy one item under its guard; None on success, else the reason it failed. With a
    `helper` (never from one of its own threads), a copy of SPLIT_BYTES or more gives it
    half of the bytes."""
    _, local, remote, guard, fence = item
    write = op == OpCode.WRITE
    try:
        token = guard.enter(fence, write)
    except KvpoolError as exc:
        return f"shm copy failed: {exc}"
    if token is None:
        return FENCED_REASON
    dst, src = (remote, local) if write else (local, remote)
    try:
        if helper is not None and dst.nbytes >= SPLIT_BYTES:
            _copy_in_two(dst, src, helper)
        else:
            copy_bytes(dst, src)
    except (ValueError, TypeError, OSError) as exc:
        return f"shm copy failed: {exc}"
    finally:
        guard.leave(token)
    return None
