"""Registered memory: what a transfer engine may read from and write into.

Every buffer is a range of absolute virtual addresses [addr, addr + length) in this process.
Lookups return a memoryview slice of the registered object, so data moves with `recv_into`,
`sendmsg` or `memcpy` straight to and from it. Reads of the table are lock-free (copy-on-write).

A managed buffer is a file in /dev/shm that starts with one header page; the buffer itself (the
registered range) is the rest of the file, so same-host peers can read the fence word:

    0          8          16                        4096                     4096 + length
    +----------+----------+--------- zero ----------+----------- buffer -----------+
    | KVPSHM01 | fence64  |                         | registered range [addr, ...) |
    +----------+----------+-------------------------+------------------------------+

A peer that writes through its mapping holds a shared `flock` on the file from its fence check
until its copy ends; the owner changes the fence word under an exclusive `flock`. So once
`set_fence` returns, no same-host write checked against the old fence is still copying.
The residual race is a peer that ignores this protocol (any process of our uid can write the
file), and a torn 8-byte read is not possible for the aligned word on the platforms we run on.
"""

from __future__ import annotations

import bisect
import ctypes
import fcntl
import itertools
import mmap
import os
import re
import stat
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvpool.errors import MemoryRegistrationError, TransferTimeout
from kvpool.transfer.fence import Fence
from kvpool.transfer.populate import Chunks, fill_in_background, map_populated


@dataclass(frozen=True, eq=False)
class Buffer:
    """A registered range. `view` is a writable (unless `readonly`) byte memoryview of it;
    `fence` is the region's write fence (see kvpool.transfer.fence)."""

    addr: int
    length: int
    view: memoryview = field(repr=False)
    readonly: bool = False
    shm_name: str | None = None
    owner: Any = field(default=None, repr=False)
    fence: Fence = field(default_factory=Fence, repr=False)

    def numpy(self) -> np.ndarray:
        return np.frombuffer(self.view, dtype=np.uint8)

    def contains(self, addr: int, length: int) -> bool:
        return self.addr <= addr and addr + length <= self.addr + self.length


def view_at(addr: int, length: int) -> memoryview:
    """A writable byte view of raw memory the caller guarantees is alive."""
    if addr <= 0 or length < 0:
        raise MemoryRegistrationError(f"invalid raw range addr={addr:#x} length={length}")
    return memoryview((ctypes.c_ubyte * length).from_address(addr)).cast("B")


def buffer_of(obj: Any) -> Buffer:
    """Describe a bytes-like object, numpy array, mmap or CPU torch tensor as a Buffer."""
    if hasattr(obj, "data_ptr") and hasattr(obj, "is_contiguous"):
        return _tensor_buffer(obj)
    if isinstance(obj, np.ndarray):
        if not obj.flags.c_contiguous:
            raise MemoryRegistrationError("numpy array must be C-contiguous to register")
        view = memoryview(obj).cast("B") if obj.nbytes else memoryview(b"")  # type: ignore[arg-type]
        return Buffer(int(obj.ctypes.data), obj.nbytes, view, not obj.flags.writeable, owner=obj)
    try:
        view = memoryview(obj)
    except TypeError:
        raise MemoryRegistrationError(f"cannot register {type(obj).__name__}: not a buffer") from None
    if not view.c_contiguous:
        raise MemoryRegistrationError("buffer must be contiguous to register")
    view = view.cast("B")
    addr = int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if view.nbytes else 0
    return Buffer(addr, view.nbytes, view, view.readonly, owner=obj)


def _tensor_buffer(tensor: Any) -> Buffer:
    if tensor.device.type != "cpu":
        raise MemoryRegistrationError(f"only CPU tensors can be registered, got {tensor.device}")
    if not tensor.is_contiguous():
        raise MemoryRegistrationError("tensor must be contiguous to register")
    length = tensor.numel() * tensor.element_size()
    addr = int(tensor.data_ptr())
    return Buffer(addr, length, view_at(addr, length), owner=tensor)


def _straddles(buffers: tuple[Buffer, ...], starts: tuple[int, ...], found: int, top: int,
               addr: int, length: int) -> bool:
    """Whether [addr, addr+length), inside `buffers[found]`, also runs into or out of a
    region registered within it (at `found`+1.. on): then no one region's read-only flag and
    fence hold for all of it, and the request is refused (OUT_OF_RANGE) rather than checked
    against the outer region alone. `top`: the last registration starting at or before
    `addr`."""
    end = addr + length
    if top + 1 < len(starts) and starts[top + 1] < end:
        return True  # one starts inside the range
    return any(buffers[k].addr + buffers[k].length > addr for k in range(found + 1, top + 1))


class MemoryRegistry:
    """The registered buffers of one engine, sorted by address (of two that start at the
    same address, the longer first: the inner one answers for its range, whichever was
    registered first)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._added: dict[int, int] = {}
        """id(buffer) -> when it was registered (a counter): of several registrations that
        start at one address, `at` and `remove` take the latest."""
        self._count = 0
        self._starts: tuple[int, ...] = ()
        self._buffers: tuple[Buffer, ...] = ()
        self._disjoint = True
        self._last: tuple[tuple[Buffer, ...], Buffer] | None = None
        """The buffer `find` found last, with the registrations it was found among: a batch
        walks through one buffer, and each of its objects is checked in several layers. Used
        only while no two registrations overlap (else `find` must keep answering the one with
        the highest start, whose read-only flag and fence hold there)."""

    def add(self, buf: Buffer) -> Buffer:
        if buf.length <= 0:
            raise MemoryRegistrationError("cannot register an empty buffer")
        with self._lock:
            for existing in self._buffers:
                if existing.addr == buf.addr and existing.length == buf.length:
                    return existing
            self._count += 1
            self._added[id(buf)] = self._count
            items = sorted((*self._buffers, buf), key=lambda b: (b.addr, -b.length))
            self._set(tuple(items))
        return buf

    def _set(self, items: tuple[Buffer, ...]) -> None:
        """Install sorted registrations (under the lock); `find` forgets its last answer."""
        self._last, self._disjoint = None, False  # no caching while the tuple changes
        self._buffers, self._starts = items, tuple(b.addr for b in items)
        self._disjoint = all(a.addr + a.length <= b.addr for a, b in itertools.pairwise(items))

    def remove(self, addr: int) -> Buffer:
        with self._lock:
            existing = self.at(addr)
            i = next(i for i, b in enumerate(self._buffers) if b is existing)
            self._set(self._buffers[:i] + self._buffers[i + 1 :])
            self._added.pop(id(existing), None)
            return existing

    def find(self, addr: int, length: int) -> Buffer | None:
        """The registered buffer that holds all of [addr, addr+length), or None."""
        buffers, starts, last = self._buffers, self._starts, self._last
        if last is not None and last[0] is buffers and last[1].contains(addr, length):
            return last[1]  # (registrations replace the tuple, so a removed one never hits)
        top = i = bisect.bisect_right(starts, addr) - 1
        while i >= 0:
            buf = buffers[i]
            if buf.contains(addr, length):
                if self._disjoint:
                    self._last = (buffers, buf)
                elif _straddles(buffers, starts, i, top, addr, length):
                    return None
                return buf
            i -= 1
        return None

    def at(self, addr: int) -> Buffer:
        """The buffer registered to start at `addr` (the latest registered of several);
        MemoryRegistrationError if none."""
        found = [b for b in self._buffers if b.addr == addr]
        if not found:
            raise MemoryRegistrationError(f"no buffer registered at {addr:#x}")
        return max(found, key=lambda b: self._added.get(id(b), 0))

    def view(self, addr: int, length: int) -> memoryview | None:
        buf = self.find(addr, length)
        if buf is None:
            return None
        start = addr - buf.addr
        return buf.view[start : start + length]

    def buffers(self) -> tuple[Buffer, ...]:
        return self._buffers


SHM_HEADER_BYTES = 4096
SHM_MAGIC = b"KVPSHM01"
FENCE_WORD = 1  # index of the fence among the header's u64 words
_LOCK_POLL_S = 0.0005


class SharedMemoryArena:
    """Managed buffers backed by files in /dev/shm, so same-host peers can map and memcpy them."""

    def __init__(self, prefix: str) -> None:
        self._prefix = prefix
        self._counter = 0
        self._lock = threading.Lock()
        self._maps: dict[int, tuple[mmap.mmap, str, int]] = {}

    def allocate(self, length: int, fence: int = 0) -> Buffer:
        if length <= 0:
            raise MemoryRegistrationError(f"managed buffer length must be > 0, got {length}")
        with self._lock:
            self._counter += 1
            name = f"{self._prefix}-{self._counter}"
        fd = os.open(f"/dev/shm/{name}", os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, SHM_HEADER_BYTES + length)
            mem = map_populated(fd, SHM_HEADER_BYTES + length)
        except BaseException as e:
            _unlink(name)
            os.close(fd)
            if isinstance(e, OSError):
                raise MemoryRegistrationError(
                    f"cannot back a {length}-byte managed buffer in /dev/shm "
                    f"({os.strerror(e.errno or 0)}); is /dev/shm large enough?") from e
            raise
        mem[: len(SHM_MAGIC)] = SHM_MAGIC
        header_words(mem)[FENCE_WORD] = fence
        view = memoryview(mem).cast("B")[SHM_HEADER_BYTES:]
        addr = int(np.frombuffer(view, dtype=np.uint8).ctypes.data)
        self._maps[addr] = (mem, name, fd)
        return Buffer(addr, length, view, shm_name=name, owner=mem, fence=Fence(fence))

    def publish_fence(self, addr: int, fence: int, timeout_s: float) -> None:
        """Publish a managed buffer's new fence to same-host writers (no-op for other memory):
        under the exclusive file lock, so no peer is between its check and its copy.
        TransferTimeout, with the word unchanged, when a peer holds the lock past `timeout_s`."""
        entry = self._maps.get(addr)
        if entry is None:
            return
        mem, name, fd = entry
        lock_file(fd, fcntl.LOCK_EX, timeout_s, f"/dev/shm/{name}")
        try:
            header_words(mem)[FENCE_WORD] = fence
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)

    def free(self, addr: int) -> None:
        mem, name, fd = self._maps.pop(addr)
        _unlink(name)
        os.close(fd)
        try:
            mem.close()
        except BufferError:
            pass  # views still exported; the mapping goes when they do

    def close(self) -> None:
        for addr in list(self._maps):
            self.free(addr)


def header_words(mem: Any) -> np.ndarray:
    """The first two u64 words of a managed buffer's header page (magic, fence)."""
    return np.frombuffer(mem, dtype="<u8", count=2)


def lock_file(fd: int, mode: int, timeout_s: float, what: str) -> None:
    """flock(fd, mode) within `timeout_s`; TransferTimeout if another process holds it."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise TransferTimeout(f"{what} stayed locked for {timeout_s:g}s") from None
            time.sleep(_LOCK_POLL_S)


def _unlink(name: str) -> None:
    try:
        os.unlink(f"/dev/shm/{name}")
    except FileNotFoundError:
        pass


SHM_NAME = re.compile(r"^kvpool-(\d+)-([0-9a-f]+)-[0-9a-f]+-\d+$")
"""Names of managed-buffer files: kvpool-<pid>-<pid namespace, hex>-<engine tag>-<counter>.
The pid means something only in the pid namespace named next to it."""


def pid_namespace() -> int:
    """An id of this process's pid namespace (the inode of /proc/self/ns/pid; 0 if unknown)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


SHM_TAG_BITS = 64
"""Bits of an engine's tag in its files' names (random: no two engines share names)."""


def shm_prefix(tag: int) -> str:
    """The prefix of one engine's managed-buffer files (see SHM_NAME)."""
    return f"kvpool-{os.getpid()}-{pid_namespace():x}-{tag & ((1 << SHM_TAG_BITS) - 1):x}"


@dataclass(frozen=True, eq=False)
class PeerMapping:
    """A same-host peer's managed buffer mapped here: its data view, header words, and an
    open fd (for the file lock and to notice an unlink), closed when the mapping is dropped.
    `chunks` populates the data area where transfers use it, and the rest in the background
    (kvpool.transfer.populate)."""

    view: memoryview
    words: np.ndarray
    fd: int
    size: int
    chunks: Chunks


def map_peer_shm(name: str, length: int, pid: int) -> PeerMapping:
    """Map a same-host peer's managed buffer. Raises OSError unless `name` is a managed-buffer
    file of process `pid`: a regular file in /dev/shm owned by us, exactly one header page plus
    `length` bytes long (a shorter file would SIGBUS a copy past its end), with the header magic.

    The pages are populated where transfers use them first and in the background (`Chunks`),
    not all before this returns.
    """
    match = SHM_NAME.match(name)
    if match is None or int(match.group(1)) != pid:
        raise OSError(f"{name!r} is not a managed buffer of process {pid}")
    fd = os.open(f"/dev/shm/{name}", os.O_RDWR | os.O_NOFOLLOW)
    try:
        size = SHM_HEADER_BYTES + length
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_size != size:
            raise OSError(f"/dev/shm/{name} is not a regular file of ours of {size} bytes")
        mem = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        if mem[: len(SHM_MAGIC)] != SHM_MAGIC:
            mem.close()
            raise OSError(f"/dev/shm/{name} has no managed-buffer header")
        chunks = Chunks(mem, SHM_HEADER_BYTES, length)
        mapping = PeerMapping(memoryview(mem).cast("B")[SHM_HEADER_BYTES:], header_words(mem), fd,
                              size, chunks)
        fill_in_background(chunks)
        weakref.finalize(mapping, os.close, fd)  # when no copy can use it any more
        return mapping
    except BaseException:
        os.close(fd)
        raise
