"""Offset allocator of one segment: best-fit over free ranges, coalescing on free.

The segment is the byte range [0, capacity). Free ranges are kept twice: by start offset
(to find neighbours when coalescing) and by (size, offset) (to find the best fit).

    0        a            a+n           b          capacity
    |--used--|----free----|----used-----|---free---|
             ^ _free_by_offset[a] = n
"""

from __future__ import annotations

import bisect

from kvpool.errors import InvalidArgument


class OffsetAllocator:
    def __init__(self, capacity: int, alignment: int = 64) -> None:
        if capacity < 0 or alignment < 1 or alignment & (alignment - 1):
            raise InvalidArgument(
                f"allocator needs capacity >= 0 and a power-of-two alignment, "
                f"got capacity={capacity} alignment={alignment}")
        self.capacity = capacity
        self.alignment = alignment
        self._offsets: list[int] = []           # sorted starts of free ranges
        self._by_size: list[tuple[int, int]] = []  # sorted (size, offset)
        self._free: dict[int, int] = {}          # offset -> size
        self._used: dict[int, int] = {}          # offset -> allocated (aligned) size
        self.used_bytes = 0
        usable = capacity - capacity % alignment
        if usable:
            self._add_free(0, usable)
        self._tail = capacity - usable           # unusable bytes at the end

    def rounded(self, size: int) -> int:
        return -(-size // self.alignment) * self.alignment

    def can_allocate(self, size: int) -> bool:
        need = self.rounded(size)
        return need > 0 and bisect.bisect_left(self._by_size, (need, -1)) < len(self._by_size)

    def allocate(self, size: int) -> int | None:
        """Offset of a new range of at least `size` bytes, or None when nothing fits."""
        if size <= 0:
            raise InvalidArgument(f"allocation size must be > 0, got {size}")
        need = self.rounded(size)
        i = bisect.bisect_left(self._by_size, (need, -1))
        if i == len(self._by_size):
            return None
        free_size, offset = self._by_size[i]
        if free_size > need:
            self._shrink_free(i, offset, free_size, need)
        else:
            self._remove_free(offset, free_size)
        self._used[offset] = need
        self.used_bytes += need
        return offset

    def allocate_run(self, sizes: list[int]) -> list[int] | None:
        """Offsets of len(sizes) consecutive ranges carved from one free range (each freed
        on its own later), or None when no free range holds them all."""
        needs = [self.rounded(size) for size in sizes]
        if not needs or min(sizes) <= 0:
            raise InvalidArgument(f"allocation sizes must be > 0, got {sizes[:8]}")
        total = sum(needs)
        i = bisect.bisect_left(self._by_size, (total, -1))
        if i == len(self._by_size):
            return None
        free_size, offset = self._by_size[i]
        if free_size > total:
            self._shrink_free(i, offset, free_size, total)
        else:
            self._remove_free(offset, free_size)
        offsets = []
        used = self._used
        for need in needs:
            used[offset] = need
            offsets.append(offset)
            offset += need
        self.used_bytes += total
        return offsets

    def reserve(self, offset: int, size: int) -> bool:
        """Take exactly [offset, offset + rounded(size)) if it is free (as `allocate` would
        have returned it); False, changing nothing, when any of it is taken or outside."""
        need = self.rounded(size)
        i = bisect.bisect_right(self._offsets, offset) - 1
        if need <= 0 or offset % self.alignment or i < 0:
            return False
        start = self._offsets[i]
        free_size = self._free[start]
        if offset + need > start + free_size:
            return False
        self._remove_free(start, free_size)
        if offset > start:
            self._add_free(start, offset - start)
        if start + free_size > offset + need:
            self._add_free(offset + need, start + free_size - offset - need)
        self._used[offset] = need
        self.used_bytes += need
        return True

    def free(self, offset: int) -> int:
        """Release the range that starts at `offset`; returns its allocated size."""
        size = self._used.pop(offset, None)
        if size is None:
            raise InvalidArgument(f"offset {offset} is not the start of an allocated range")
        self.used_bytes -= size
        start, end = offset, offset + size
        i = bisect.bisect_left(self._offsets, offset)
        if i < len(self._offsets) and self._offsets[i] == end:
            nxt = self._offsets[i]
            end = nxt + self._free[nxt]
            self._remove_free(nxt, self._free[nxt])
        if i > 0:
            prev = self._offsets[i - 1]
            if prev + self._free[prev] == start:
                start = prev
                self._remove_free(prev, self._free[prev])
        self._add_free(start, end - start)
        return size

    @property
    def free_bytes(self) -> int:
        return self.capacity - self._tail - self.used_bytes

    @property
    def largest_free(self) -> int:
        return self._by_size[-1][0] if self._by_size else 0

    @property
    def num_free_ranges(self) -> int:
        return len(self._offsets)

    def allocated_ranges(self) -> dict[int, int]:
        return dict(self._used)

    def check_integrity(self) -> None:
        """Raise AssertionError unless free + used == total and no two ranges overlap."""
        ranges = sorted([(o, s, "free") for o, s in self._free.items()]
                        + [(o, s, "used") for o, s in self._used.items()])
        pos = 0
        for offset, size, kind in ranges:
            assert offset == pos, f"gap or overlap at {pos}: next {kind} range starts at {offset}"
            assert size > 0, f"empty {kind} range at {offset}"
            pos = offset + size
        assert pos == self.capacity - self._tail, f"ranges end at {pos}, not {self.capacity}"
        total_free = sum(self._free.values())
        assert total_free + self.used_bytes + self._tail == self.capacity, "free + used != total"
        assert sorted(self._free) == self._offsets, "offset index out of sync"
        assert sorted((s, o) for o, s in self._free.items()) == self._by_size, "size index stale"
        for (o1, s1), o2 in zip(sorted(self._free.items()), self._offsets[1:], strict=False):
            assert o1 + s1 < o2, f"free ranges at {o1} and {o2} were not coalesced"

    def _add_free(self, offset: int, size: int) -> None:
        self._free[offset] = size
        bisect.insort(self._offsets, offset)
        bisect.insort(self._by_size, (size, offset))

    def _shrink_free(self, i: int, offset: int, size: int, cut: int) -> None:
        """Give the first `cut` bytes of the free range at `offset` (index i by size) away,
        updating both indexes in place where the order allows (the common bump case)."""
        rest, start = size - cut, offset + cut
        self._offsets[bisect.bisect_left(self._offsets, offset)] = start
        del self._free[offset]
        self._free[start] = rest
        k = bisect.bisect_left(self._by_size, (rest, start))  # k <= i: the range got smaller
        if k == i:
            self._by_size[i] = (rest, start)
        else:
            del self._by_size[i]
            self._by_size.insert(k, (rest, start))

    def _remove_free(self, offset: int, size: int) -> None:
        del self._free[offset]
        del self._offsets[bisect.bisect_left(self._offsets, offset)]
        del self._by_size[bisect.bisect_left(self._by_size, (size, offset))]
