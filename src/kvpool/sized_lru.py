"""A map that lets its least recently used entries go while the sum of their costs is over a
budget: the proxy's memories of prompts (their pieces' token ids, their blocks' hashes) use it.
Not locked: its users hold their own lock around a lookup and its insert."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")

MAX_ENTRY_SHARE = 8
"""An entry over 1/8 of the budget is not kept (it would push out most of the others)."""


class SizedLru(Generic[K, V]):
    def __init__(self, budget_bytes: int, cost: Callable[[K, V], int]) -> None:
        self.budget_bytes = budget_bytes
        self._cost = cost
        self._entries: OrderedDict[K, V] = OrderedDict()
        self.size_bytes = 0
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: K) -> bool:
        return key in self._entries

    def get(self, key: K) -> V | None:
        """The value kept for `key`, now the most recently used; None if none is."""
        value = self._entries.get(key)
        if value is not None:
            self._entries.move_to_end(key)
        return value

    def put(self, key: K, value: V) -> None:
        """Keep `value` for `key` (a key kept already keeps its value), letting the least
        recently used go while over the budget."""
        cost = self._cost(key, value)
        if cost * MAX_ENTRY_SHARE > self.budget_bytes or key in self._entries:
            return
        self._entries[key] = value
        self.size_bytes += cost
        while self.size_bytes > self.budget_bytes:
            old, old_value = self._entries.popitem(last=False)
            self.size_bytes -= self._cost(old, old_value)
            self.evicted += 1

    def clear(self) -> None:
        self._entries.clear()
        self.size_bytes = self.evicted = 0
