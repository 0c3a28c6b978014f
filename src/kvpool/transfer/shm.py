"""The shm transport: same-host peers' managed buffers, mapped from /dev/shm and copied directly."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from kvpool.transfer.batch import Batch, OpCode
from kvpool.transfer.memory import map_peer_shm
from kvpool.transfer.segment import ProcessWatch, SegmentDescriptor

_NUMPY_COPY_BYTES = 64 << 10
_INLINE_BYTES = 256 << 10


def copy_bytes(dst: memoryview, src: memoryview) -> None:
    """memcpy; numpy for large copies since it releases the GIL."""
    if dst.nbytes >= _NUMPY_COPY_BYTES:
        np.copyto(np.frombuffer(dst, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8))
    else:
        dst[:] = src


class ShmPeer:
    """The shared regions of one same-host peer, mapped on first use.

    A region whose file the peer has since unlinked (freed) no longer resolves, so requests to
    it go over tcp and get the target's verdict instead of landing in orphaned memory.
    """

    def __init__(self, descriptor: SegmentDescriptor) -> None:
        self.descriptor = descriptor
        self.watch = ProcessWatch(descriptor.pid)
        self._maps: dict[str, tuple[memoryview, int]] = {}
        self._lock = threading.Lock()

    def resolve(self, addr: int, length: int) -> memoryview | None:
        for region in self.descriptor.shm_regions:
            if region.addr <= addr and addr + length <= region.addr + region.length:
                view = self._map(region.name, region.length)
                if view is None:
                    return None
                start = addr - region.addr
                return view[start : start + length]
        return None

    def _map(self, name: str, length: int) -> memoryview | None:
        with self._lock:
            entry = self._maps.get(name)
            if entry is None:
                try:
                    entry = map_peer_shm(name, length, self.descriptor.pid)
                except OSError:
                    return None
                self._maps[name] = entry
            view, fd = entry
            if os.fstat(fd).st_nlink == 0:  # freed by its owner since we mapped it
                return None
            return view

    def close(self) -> None:
        with self._lock:
            maps, self._maps = self._maps, {}
        for _, fd in maps.values():
            os.close(fd)


class ShmTransport:
    """Runs copies inline when small, on a small thread pool when large."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvpool-shm")

    def run(self, op: OpCode, batch: Batch, items: list[tuple[int, memoryview, memoryview]],
            peer: ShmPeer | None, inline: bool = False) -> None:
        """items: (request index, local view, remote view). Small copies (all copies when
        `inline`) run in the caller's thread; large async ones on the pool."""
        total = sum(local.nbytes for _, local, _ in items)
        if inline or total <= _INLINE_BYTES:
            _copy_all(op, batch, items, peer)
        else:
            self._pool.submit(_copy_all, op, batch, items, peer)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _copy_all(op: OpCode, batch: Batch, items: list[tuple[int, memoryview, memoryview]],
              peer: ShmPeer | None) -> None:
    indices = [index for index, _, _ in items]
    if peer is not None and not peer.watch.alive():
        batch.complete(indices, f"peer process {peer.watch.pid} ({peer.descriptor.name}) is gone")
        return
    try:
        for _, local, remote in items:
            if op == OpCode.WRITE:
                copy_bytes(remote, local)
            else:
                copy_bytes(local, remote)
    except (ValueError, TypeError, OSError) as exc:
        batch.complete(indices, f"shm copy failed: {exc}")
        return
    batch.complete(indices, whole=True)
