"""Files the master no longer tracks but a node may still hold, and register again when it
comes back (`LeftFiles`, one in tier_state.py's TierState).

A node that dies (or is dropped for its silence) takes its queue with it: the files of its
disk replicas, the DELETEs it had not run yet and the offloads it may have written stay on
its disk. When it mounts again it registers every file it has, and the master takes a file
whose key it does not know as that key's object. That is right for a value nobody replaced
(the pool keeps it), and wrong for one removed or put again since: the old bytes would come
back, with their own checksum, so no reader could tell. So the master remembers, by key,
the generation of each such file (`left`) and, once the key is removed or replaced, refuses
that generation at registration (`void`); the node then deletes the file. A generation is a
random 64-bit number, so one never matches another key's file.

Kept in memory: a master restarted without its state directory knows none of this, and
takes every file back, as before. At most MAX_FILES generations are remembered (the oldest
forgotten first).
"""

from __future__ import annotations

from collections import OrderedDict

MAX_FILES = 1 << 20


class LeftFiles:
    def __init__(self, max_files: int = MAX_FILES) -> None:
        self._left: dict[str, set[int]] = {}
        """Key -> generations of its files left on disks the master no longer tracks, valid
        while the key's object stands."""
        self._void: OrderedDict[tuple[str, int], None] = OrderedDict()
        """(key, generation) of files to refuse: their key was removed or replaced since."""
        self._max = max_files
        self._num_left = 0

    def __bool__(self) -> bool:
        return bool(self._left or self._void)

    def __len__(self) -> int:
        return self._num_left + len(self._void)

    def left(self, key: str, gen: int) -> None:
        """A file of `key` may stay on a disk the master lost: good while `key` stands."""
        gens = self._left.setdefault(key, set())
        if gen not in gens:
            gens.add(gen)
            self._num_left += 1
            self._bound()

    def void(self, key: str, gen: int) -> None:
        """A file of `key` that must never be taken back (its DELETE was not run)."""
        self._void[(key, gen)] = None
        self._bound()

    def key_gone(self, key: str) -> None:
        """`key`'s object was removed or replaced: its files left behind are stale."""
        gens = self._left.pop(key, None)
        if gens:
            self._num_left -= len(gens)
            for gen in gens:
                self.void(key, gen)

    def refuse(self, key: str, gen: int) -> bool:
        """A node registers a file of `key`: whether it is stale (then it is forgotten, the
        node deletes it). Otherwise it is tracked again and leaves this table."""
        if (key, gen) in self._void:
            del self._void[(key, gen)]
            return True
        gens = self._left.get(key)
        if gens is not None and gen in gens:
            gens.discard(gen)
            self._num_left -= 1
            if not gens:
                del self._left[key]
        return False

    def _bound(self) -> None:
        while len(self) > self._max:
            if self._void:
                self._void.popitem(last=False)
                continue
            key = next(iter(self._left))
            self._num_left -= len(self._left.pop(key))

    def check_integrity(self) -> None:
        assert self._num_left == sum(len(g) for g in self._left.values()), "left count"
        assert all(self._left.values()), "an empty set of left files"
        assert len(self) <= self._max, "over the bound"
