"""Managed buffers are mapped populated: the first transfer into a fresh one takes no page
faults (a fault per 4 KiB page made first reads several times slower than later ones)."""

from __future__ import annotations

import mmap
import resource

import numpy as np
import pytest

from kvpool.transfer.memory import SharedMemoryArena, shm_prefix

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
