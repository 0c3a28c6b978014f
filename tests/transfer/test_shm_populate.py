"""Managed buffers are mapped populated and writable: the first transfer into a fresh one takes
no page faults (a fault per 4 KiB page made first reads several times slower than later ones),
and a buffer that /dev/shm cannot hold is refused when it is allocated. A peer's mapping of a
buffer is populated chunk by chunk where transfers use it, and the rest in the background."""

from __future__ import annotations

import mmap
import os
import resource
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest

from kvpool.transfer import memory, populate
from kvpool.transfer.memory import Buffer, SharedMemoryArena, shm_prefix
from tests.support.require import missing
from tests.support.wait import wait_for

SIZE = 16 << 20


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


@pytest.mark.skipif(not hasattr(mmap, "MAP_POPULATE"), reason="needs MAP_POPULATE (Linux)")
def test_first_write_into_a_fresh_managed_buffer_takes_no_page_faults() -> None:
    arena = SharedMemoryArena(shm_prefix(0x5EED))
    try:
        buf = arena.allocate(SIZE)
        source = np.ones(SIZE, dtype=np.uint8)  # faulted in before counting
        before = _minor_faults()
        np.copyto(buf.numpy(), source)
        faults = _minor_faults() - before
        assert faults < SIZE // 4096 // 8, f"{faults} page faults on the first copy"
        assert int(buf.numpy().sum()) == SIZE
    finally:
        arena.close()


def test_kernels_without_populate_write_fall_back_to_map_populate(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """An advice the kernel does not know gets EINVAL, as MADV_POPULATE_WRITE does before 5.14."""
    monkeypatch.setattr(populate, "MADV_POPULATE_WRITE", 0x7FFF)
    arena = SharedMemoryArena(shm_prefix(0x5EEE))
    try:
        buf = arena.allocate(1 << 20)
        buf.numpy()[:] = 7
        assert int(buf.numpy().sum()) == 7 << 20
    finally:
        arena.close()


_TOO_BIG = """
import os, sys
from kvpool.errors import MemoryRegistrationError
from kvpool.transfer.memory import SharedMemoryArena
arena = SharedMemoryArena(f"kvpool-{os.getpid()}-cafe")
try:
    arena.allocate(64 << 20)
except MemoryRegistrationError as e:
    print("refused:", e)
print("left:", os.listdir("/dev/shm"))
small = arena.allocate(8 << 20)
small.numpy()[:] = 1
print("small:", int(small.numpy().sum()))
"""


def test_a_buffer_dev_shm_cannot_hold_is_refused_at_allocation_not_sigbus_later() -> None:
    """In a mount namespace with a 32 MiB /dev/shm, a 64 MiB managed buffer is a clear error
    (before, MAP_POPULATE ignored the shortage and the first copy past it killed the process)."""
    if shutil.which("unshare") is None or os.geteuid() != 0:
        missing("needs root and unshare(1) for a private tmpfs")
    script = f"mount -t tmpfs -o size=32m tmpfs /dev/shm && exec {sys.executable} -c '{_TOO_BIG}'"
    done = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True,
                          timeout=60)
    if done.returncode != 0 and "mount" in done.stderr:
        missing(f"cannot mount a private tmpfs here: {done.stderr.strip()}")
    assert done.returncode == 0, done.stderr
    assert "refused: cannot back a 67108864-byte managed buffer in /dev/shm" in done.stdout
    assert "left: []" in done.stdout
    assert f"small: {8 << 20}" in done.stdout


def _rss_kib(start: int) -> int:
    """Rss of this process's mapping that starts at `start`, from /proc/self/smaps."""
    with open("/proc/self/smaps") as smaps:
        found = False
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                found = int(head.split("-")[0], 16) == start
            elif found and head == "Rss:":
                return int(line.split()[1])
    raise AssertionError(f"no mapping at {start:#x}")


@contextmanager
def _mapped_as_peer(tag: int, length: int) -> Iterator[tuple[Buffer, memory.PeerMapping, int]]:
    """A fresh managed buffer, this process's peer mapping of it, and where that starts."""
    arena = SharedMemoryArena(shm_prefix(tag))
    try:
        buf = arena.allocate(length)
        assert buf.shm_name is not None
        peer = memory.map_peer_shm(buf.shm_name, buf.length, os.getpid())
        yield buf, peer, np.frombuffer(peer.view, dtype=np.uint8).ctypes.data - memory.SHM_HEADER_BYTES
    finally:
        arena.close()


_SMAPS = pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs /proc/self/smaps")


@_SMAPS
def test_a_peer_mapping_is_populated_where_transfers_use_it_not_at_first_contact(
        monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Mapping a peer's whole buffer populated cost 70 ms per GiB at first contact; now each
    2 MiB chunk is populated when a transfer first uses it (and the rest in the background,
    held back here)."""
    monkeypatch.setattr(memory, "fill_in_background", lambda chunks: None)
    with _mapped_as_peer(0x5EEF, 64 << 20) as (buf, peer, start):
        header = _rss_kib(start)  # the header page read, with the kernel's fault-around
        assert header <= 64
        peer.chunks.prepare(3 << 20, 1 << 20)  # inside the second 2 MiB chunk
        assert _rss_kib(start) == header + 2048
        peer.chunks.prepare(2 << 20, 2 << 20)  # the same chunk: nothing more
        assert _rss_kib(start) == header + 2048
        peer.view[3 << 20 : 4 << 20] = b"\x07" * (1 << 20)
        assert int(buf.numpy()[3 << 20 : 4 << 20].sum()) == 7 << 20
        peer.chunks.prepare((64 << 20) - 1, 1)  # the last chunk
        assert _rss_kib(start) == header + 4096


@_SMAPS
def test_the_rest_of_a_peer_mapping_is_populated_in_the_background() -> None:
    with _mapped_as_peer(0x5EF0, 64 << 20) as (_, _peer, start):
        wait_for(lambda: _rss_kib(start) >= 64 << 10, 10.0, "64 MiB resident", 0.01)


def test_a_background_fill_stops_once_its_mapping_is_dropped() -> None:
    """The filler holds the chunks (and so the mapping) only while populating one chunk."""
    calls: list[int] = []
    gate = threading.Event()

    class Gated(populate.Chunks):
        def populate(self, chunk: int) -> None:
            calls.append(chunk)
            gate.wait(10)
            super().populate(chunk)

    chunks = Gated(mmap.mmap(-1, 64 << 20), 0, 64 << 20)  # 32 chunks
    thread = populate.fill_in_background(chunks)
    wait_for(lambda: calls, 10.0, "the filler's first chunk", 0.001)
    del chunks
    gate.set()
    thread.join(10)
    assert not thread.is_alive()
    assert calls == [0]
