"""Pure planning of client transfers: which local bytes go to (or come from) which replica
address. No I/O here; the client turns plans into transfer-engine requests.

An object may be scattered over several local pieces ("parts"). Object bytes are laid out
in part order:

    object:  |<--- part 0 --->|<-- part 1 -->|<--- part 2 --->|
    offset   0                n0             n0+n1

A plan is a list of `Copy`, the one shape a copy has from here to the wire: its fields are a
`TransferRequest`'s after `op`, in the same order, so `copy.request(op)` is the request.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from kvpool.store.wire.codes import ReplicaDesc, Tier
from kvpool.transfer.batch import OpCode, TransferRequest

_new = tuple.__new__
Part = tuple[int, int]
"""(local address, length in bytes)."""


class Copy(NamedTuple):
    """One transfer of a read or a write between local memory and one replica."""

    local_addr: int
    length: int
    target: str
    """The replica's transfer-engine segment name (its owner's endpoint, "host:port")."""
    target_addr: int
    fence: int = 0
    """The replica's write fence (ReplicaDesc.fence): the owner refuses it once stale."""

    def request(self, op: OpCode) -> TransferRequest:
        return _new(TransferRequest, (op, *self))  # (the named tuple's own __new__: 2x slower)


def parts_total(parts: Sequence[Part]) -> int:
    if len(parts) == 1:  # the common case, once per object on every call
        return parts[0][1]
    return sum(length for _, length in parts)


def valid_parts(parts: object) -> bool:
    """A non-empty list or tuple of (address > 0, length >= 0) int pairs, not all empty."""
    if not isinstance(parts, (list, tuple)) or not parts:
        return False
    total = 0
    for part in parts:
        if not isinstance(part, (tuple, list)) or len(part) != 2:
            return False
        addr, length = part
        if type(addr) is not int or type(length) is not int or addr <= 0 or length < 0:
            return False
        total += length
    return total > 0


def copies_for(parts: Sequence[Part], replica: ReplicaDesc, num_bytes: int) -> list[Copy]:
    """Copies moving the first `num_bytes` object bytes between `parts` and `replica` (the
    tail of the parts is left untouched when they are larger)."""
    target, base, fence = replica.endpoint, replica.addr, replica.fence
    if len(parts) == 1:  # the common case: one piece, one copy
        n = min(parts[0][1], num_bytes)
        return [_new(Copy, (parts[0][0], n, target, base, fence))] if n else []
    copies: list[Copy] = []
    offset = 0
    for addr, length in parts:
        if offset >= num_bytes:
            break
        n = min(length, num_bytes - offset)
        if n:
            copies.append(Copy(addr, n, target, base + offset, fence))
        offset += n
    return copies


def order_replicas(replicas: Sequence[ReplicaDesc], own_endpoint: str,
                   own_host: str) -> list[ReplicaDesc]:
    """Closest first: our own segment (memcpy), then same host (shm), then the rest (tcp)."""
    if len(replicas) < 2:
        return list(replicas)

    def distance(r: ReplicaDesc) -> int:
        if r.endpoint == own_endpoint:
            return 0
        return 1 if r.host == own_host else 2
    return sorted(replicas, key=distance)


def dram_first(replicas: Sequence[ReplicaDesc], endpoint: str, host: str) -> list[ReplicaDesc]:
    """The DRAM replicas, closest first (a disk replica is read through a load, never at
    its address)."""
    if len(replicas) == 1:  # the common case: no list to filter, nothing to order
        return [replicas[0]] if replicas[0].tier is Tier.DRAM else []
    return order_replicas([r for r in replicas if r.tier is Tier.DRAM], endpoint, host)
