"""Making shared-memory pages present and writable before transfers touch them.

A transfer into a page this process has not mapped yet pays a fault (0.9 us per 4 KiB page
here), and so does the first write into a page mapped by MAP_POPULATE: on a *shared* mapping
it installs the pages read-only, and each first write still traps (0.38 us per page; it
halved the rate of copies into pool memory). MADV_POPULATE_WRITE (Linux 5.14) maps pages
writable in one pass, at the cost of MAP_POPULATE (docs/perf.md, "Writable mappings").

Policy: the owner of a buffer populates all of it when it allocates it (`map_populated`: it
also learns there whether /dev/shm can hold it). A peer mapping someone else's buffer
populates chunk by chunk (`Chunks`): a chunk a transfer is about to use right away, and the
rest on a low-priority background thread (`fill_in_background`), so the first transfer does
not wait for the whole buffer (70-110 ms per GiB) and later ones find it ready.

madvise is called through ctypes, which releases the GIL: populating a large buffer must not
stop the process's other threads (heartbeats, transfers).
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading
import weakref

MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
CHUNK_BYTES = 2 << 20
"""A peer's buffer is populated in chunks of this size."""

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_libc.madvise.restype = ctypes.c_int


def madvise(addr: int, length: int, advice: int) -> int:
    """madvise(2) without the GIL; 0 or the errno."""
    if _libc.madvise(addr, length, advice) == 0:
        return 0
    return ctypes.get_errno()


def map_populated(fd: int, size: int) -> mmap.mmap:
    """Map `size` bytes of a shared-memory file with every page present and writable. Raises
    OSError (EFAULT or ENOMEM) when /dev/shm cannot hold them, where MAP_POPULATE would have
    mapped them anyway and the first copy past the shortage would have died of SIGBUS.
    Kernels before 5.14 get MAP_POPULATE and a write to every page (which, there, dies of
    SIGBUS on such a shortage)."""
    mem = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
    code = madvise(address_of(mem), size, MADV_POPULATE_WRITE)
    if code == 0:
        return mem
    mem.close()
    if code != errno.EINVAL:
        raise OSError(code, os.strerror(code))
    mem = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    with memoryview(mem) as view:  # a fresh file: its pages are all zero
        view[:: mmap.PAGESIZE] = bytes(-(-size // mmap.PAGESIZE))
    return mem


def address_of(mem: mmap.mmap) -> int:
    """The address a mapping starts at."""
    buf = (ctypes.c_char * 1).from_buffer(mem)
    try:
        return ctypes.addressof(buf)
    finally:
        del buf  # release the export, so the mapping can still be closed


class Chunks:
    """Which CHUNK_BYTES chunks of the `length` bytes at `offset` in mapping `mem` are
    populated. Holds `mem`, so the memory stays mapped while it exists."""

    def __init__(self, mem: mmap.mmap, offset: int, length: int) -> None:
        self._mem = mem
        self._addr, self._length = address_of(mem) + offset, length
        self._ready = bytearray(-(-length // CHUNK_BYTES))

    def prepare(self, start: int, length: int) -> None:
        """Populate the chunks of [start, start+length) not populated yet."""
        first, last = start // CHUNK_BYTES, (start + max(length, 1) - 1) // CHUNK_BYTES
        if self._ready.find(0, first, last + 1) >= 0:
            for chunk in range(first, last + 1):
                self.populate(chunk)

    def populate(self, chunk: int) -> None:
        """No lock: two threads populating one chunk at once do no harm, and the background
        thread, at the lowest priority, must never make a transfer wait for it."""
        if self._ready[chunk]:
            return
        offset = chunk * CHUNK_BYTES
        code = madvise(self._addr + offset, min(CHUNK_BYTES, self._length - offset),
                       MADV_POPULATE_WRITE)
        # after a failure the copy faults the pages in itself; an old kernel never will
        self._ready[chunk] = code in (0, errno.EINVAL)

    def __len__(self) -> int:
        return len(self._ready)


def fill_in_background(chunks: Chunks) -> threading.Thread:
    """Populate every chunk on a daemon thread at the lowest CPU priority. It holds `chunks`
    (and so the mapping) only while populating one chunk, and stops once it is dropped."""
    ref = weakref.ref(chunks)
    count = len(chunks)

    def fill() -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except OSError:
            pass
        for chunk in range(count):
            held = ref()
            if held is None:
                return
            held.populate(chunk)
            del held

    thread = threading.Thread(target=fill, name="kvpool-shm-populate", daemon=True)
    thread.start()
    return thread
