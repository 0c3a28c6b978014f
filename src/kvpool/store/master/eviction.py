"""Eviction policies: which objects to drop, in which order. The master does the dropping.

A policy only tracks access order; the master asks it for victims and decides which of them
are eligible (not leased, not hard-pinned; soft-pinned only in a second pass).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from typing import Protocol

from kvpool.errors import ConfigError
from kvpool.registry import lookup


class EvictionPolicy(Protocol):
    name: str

    def on_insert(self, key: str) -> None: ...

    def on_access(self, key: str) -> None: ...

    def on_remove(self, key: str) -> None: ...

    def victims(self) -> Iterator[str]:
        """Keys from the best to evict to the worst; the policy may not be changed while
        the iterator is in use."""
        ...


class LruEvictionPolicy:
    """Least recently accessed first (puts and lookups count as access)."""

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[str, None] = OrderedDict()

    def on_insert(self, key: str) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def on_access(self, key: str) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def on_remove(self, key: str) -> None:
        self._order.pop(key, None)

    def victims(self) -> Iterator[str]:
        return iter(self._order)


class FifoEvictionPolicy(LruEvictionPolicy):
    """Oldest insertion first; lookups do not refresh."""

    name = "fifo"

    def on_access(self, key: str) -> None:
        return None


EVICTION_POLICIES: dict[str, type[LruEvictionPolicy]] = {
    "lru": LruEvictionPolicy,
    "fifo": FifoEvictionPolicy,
}


def create_eviction_policy(name: str) -> EvictionPolicy:
    return lookup(EVICTION_POLICIES, "eviction policy", name, ConfigError)()
