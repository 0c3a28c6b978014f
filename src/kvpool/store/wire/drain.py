"""Typed results of the drain ops (DRAIN_BEGIN, REPLICATE_START, REPLICATE_END, DRAIN_END).

Named tuples, like ReplicaDesc: they travel as arrays, and the client decodes a reply
straight into them (the `Reply` of the messages in messages.py), types checked.

A drain, seen from the client that runs it (`kvpool store-node drain ADDR`):

    DRAIN_BEGIN(addr)        -> DrainPlan     the node's segments take no new placements
    loop:
      REPLICATE_START(addr)  -> DrainStep     moves: a new range per object, pending
      read each source, verify its checksum, write the target
      REPLICATE_END(keys, codes)              OK: the new replica replaces the drained one
    until DrainStep.done
    DRAIN_END(addr)                           only to give up (placements resume)
"""

from __future__ import annotations

from typing import NamedTuple

from kvpool.store.wire.codes import ErrorCode, ReplicaDesc


class DrainPlan(NamedTuple):
    """What draining an address involves, as found when the drain began (or a dry run)."""

    code: ErrorCode
    """OK, or SEGMENT_NOT_FOUND when no mounted segment has that endpoint or id."""
    segment_ids: tuple[str, ...] = ()
    num_objects: int = 0
    """Complete objects with a replica on the drained segments."""
    num_bytes: int = 0
    num_other_replica: int = 0
    """Of those, objects that also have a replica on a segment that stays."""
    free_bytes: int = 0
    """Free bytes on the segments that stay (before fragmentation)."""
    num_pending: int = 0
    """Puts still writing to the drained segments (waited for)."""


class ReplicaMove(NamedTuple):
    """One object to copy: read any of `sources` (all complete replicas), check the bytes
    against `checksum`, write them to `target` (pending: nobody reads it before the end)."""

    key: str
    size: int
    checksum: int | None
    lease_ttl_s: float
    sources: tuple[ReplicaDesc, ...]
    target: ReplicaDesc


class Unplaced(NamedTuple):
    """An object that stays on the drained node, and why (NO_AVAILABLE_HANDLE: no segment
    that stays has room for it)."""

    key: str
    size: int
    code: ErrorCode


class DrainStep(NamedTuple):
    """One batch of a drain."""

    code: ErrorCode
    """OK, or SEGMENT_NOT_FOUND when the address is not being drained (any more)."""
    moves: tuple[ReplicaMove, ...] = ()
    num_dropped: int = 0
    """Objects whose drained replica was dropped because another replica stays and no
    further segment had room for a new one."""
    dropped_bytes: int = 0
    unplaced: tuple[Unplaced, ...] = ()
    num_pending: int = 0
    """Puts and moves still in flight on the drained segments."""
    done: bool = False
    """Nothing is left on the drained segments but the unplaced objects of this drain."""
