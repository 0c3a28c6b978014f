"""The read side shared by the master's keyed tables (objects, pending puts): a table keeps its
rows in `_by_key` and is read like a mapping; only its own methods write."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, KeysView, ValuesView
from typing import Generic, TypeVar

V = TypeVar("V")


class KeyedReads(Generic[V]):
    _by_key: dict[str, V]

    def __getitem__(self, key: str) -> V:
        return self._by_key[key]

    def __contains__(self, key: object) -> bool:
        return key in self._by_key

    def holds_any(self, keys: Iterable[str]) -> bool:
        """Whether any of `keys` has a row (one C call for a whole batch)."""
        return not self._by_key.keys().isdisjoint(keys)

    def __len__(self) -> int:
        return len(self._by_key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_key)

    def keys(self) -> KeysView[str]:
        return self._by_key.keys()

    def values(self) -> ValuesView[V]:
        return self._by_key.values()

    def items(self) -> Iterator[tuple[str, V]]:
        return iter(self._by_key.items())
