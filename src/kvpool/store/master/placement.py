"""Replica placement policies: the order in which segments are tried for a new object."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Protocol

from kvpool.errors import ConfigError
from kvpool.store.master.state import Segment


class PlacementPolicy(Protocol):
    name: str

    def order(self, segments: Sequence[Segment], size: int) -> list[Segment]: ...


class RandomPlacement:
    name = "random"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def order(self, segments: Sequence[Segment], size: int) -> list[Segment]:
        # A random rotation: as fair as a shuffle for choosing the first segments, and cheap.
        if len(segments) <= 1:
            return list(segments)
        i = int(self._rng.random() * len(segments))
        return [*segments[i:], *segments[:i]]


class FreeRatioFirstPlacement:
    name = "free_ratio_first"

    def __init__(self, seed: int | None = None) -> None:
        del seed

    def order(self, segments: Sequence[Segment], size: int) -> list[Segment]:
        return sorted(segments, key=lambda s: (s.allocator.used_bytes / max(1, s.capacity),
                                               s.segment_id))


def create_placement(name: str, seed: int | None = None) -> PlacementPolicy:
    if name == "random":
        return RandomPlacement(seed)
    if name == "free_ratio_first":
        return FreeRatioFirstPlacement(seed)
    raise ConfigError(f"unknown allocation strategy {name!r}: use random or free_ratio_first")


def pick_segments(ordered: list[Segment], preferred: Sequence[str], size: int,
                  count: int) -> list[Segment]:
    """Up to `count` distinct segments that can hold `size`, preferred ones first, then
    segments of clients not chosen yet (so replicas land on different processes)."""
    chosen: list[Segment] = []
    if count == 1 and not preferred:
        return [s for s in ordered if s.allocator.can_allocate(size)][:1]
    by_name = {s.segment_id: s for s in ordered} | {s.endpoint: s for s in ordered}
    for name in preferred:
        found = by_name.get(name)
        if found is not None and found not in chosen and found.allocator.can_allocate(size):
            chosen.append(found)
    owners = {s.client_id for s in chosen}
    for distinct_owner in (True, False):
        for seg in ordered:
            if len(chosen) >= count:
                return chosen[:count]
            if seg in chosen or (distinct_owner and seg.client_id in owners):
                continue
            if seg.allocator.can_allocate(size):
                chosen.append(seg)
                owners.add(seg.client_id)
    return chosen[:count]
