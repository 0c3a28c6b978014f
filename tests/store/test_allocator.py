from __future__ import annotations

import random

import pytest

from kvpool.errors import InvalidArgument
from kvpool.store.allocator import OffsetAllocator


def test_best_fit_and_coalescing() -> None:
    a = OffsetAllocator(1024, alignment=64)
    offs = [a.allocate(64) for _ in range(16)]
    assert offs == [i * 64 for i in range(16)]
    assert a.allocate(1) is None
    a.free(64)
    a.free(192)
    a.free(128)  # joins 64..256 into one range
    a.check_integrity()
    assert a.num_free_ranges == 1 and a.largest_free == 192
    assert a.allocate(130) == 64     # rounds to 192, the only fit
    assert a.free_bytes == 0
    a.check_integrity()


def test_best_fit_prefers_smallest_hole() -> None:
    a = OffsetAllocator(1024, alignment=64)
    for _ in range(16):
        a.allocate(64)
    a.free(0)
    a.free(256)
    a.free(320)   # hole of 128 at 256, hole of 64 at 0
    assert a.allocate(60) == 0
    assert a.allocate(100) == 256


def test_capacity_not_multiple_of_alignment() -> None:
    a = OffsetAllocator(100, alignment=64)
    assert a.allocate(64) == 0
    assert a.allocate(1) is None
    a.check_integrity()
    assert a.free_bytes == 0


def test_misuse_raises() -> None:
    a = OffsetAllocator(1024)
    with pytest.raises(InvalidArgument):
        a.allocate(0)
    with pytest.raises(InvalidArgument):
        a.free(64)
    with pytest.raises(InvalidArgument):
        OffsetAllocator(1024, alignment=3)


def test_random_workload_keeps_integrity() -> None:
    rng = random.Random(3)
    a = OffsetAllocator(1 << 20, alignment=64)
    live: list[int] = []
    for _ in range(3000):
        if live and rng.random() < 0.45:
            a.free(live.pop(rng.randrange(len(live))))
        else:
            off = a.allocate(rng.randint(1, 20000))
            if off is not None:
                live.append(off)
    a.check_integrity()
    for off in live:
        a.free(off)
    a.check_integrity()
    assert a.num_free_ranges == 1 and a.free_bytes == 1 << 20


def test_allocate_run_carves_consecutive_ranges() -> None:
    a = OffsetAllocator(4096, alignment=64)
    assert a.allocate(100) == 0                      # 128 used
    assert a.allocate_run([64, 1, 200]) == [128, 192, 256]
    a.check_integrity()
    assert a.used_bytes == 128 + 64 + 64 + 256
    a.free(192)
    a.check_integrity()
    assert a.allocate_run([4000]) is None
    assert a.allocate_run([64]) == [192]             # best fit: the hole just freed
    for off in (0, 128, 192, 256):
        a.free(off)
    a.check_integrity()
    assert a.num_free_ranges == 1
    with pytest.raises(InvalidArgument):
        a.allocate_run([64, 0])


def test_reserve_takes_exactly_a_free_range() -> None:
    from kvpool.store.allocator import OffsetAllocator
    a = OffsetAllocator(1024, 64)
    assert a.reserve(128, 100)                     # rounded to 128: [128, 256)
    a.check_integrity()
    assert not a.reserve(192, 64) and not a.reserve(100, 64) and not a.reserve(960, 128)
    assert a.allocate(128) == 0 and a.allocate(64) is not None
    assert a.allocated_ranges()[128] == 128
    a.free(128)
    a.check_integrity()
    assert a.reserve(896, 128) and not a.reserve(0, 64)
    a.check_integrity()
