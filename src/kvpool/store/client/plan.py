"""Pure planning of client transfers: which local bytes go to (or come from) which replica
address. No I/O here; the client turns plans into transfer-engine requests.

An object may be scattered over several local pieces ("parts"). Object bytes are laid out
in part order:

    object:  |<--- part 0 --->|<-- part 1 -->|<--- part 2 --->|
    offset   0                n0             n0+n1
"""

from __future__ import annotations

from collections.abc import Sequence

from kvpool.store.wire.codes import ReplicaDesc

Part = tuple[int, int]
"""(local address, length in bytes)."""
Copy = tuple[int, int, int]
"""(local address, remote address, length)."""


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


def copies_for(parts: Sequence[Part], remote_addr: int, num_bytes: int) -> list[Copy]:
    """Copies moving the first `num_bytes` object bytes between `parts` and the replica at
    `remote_addr` (the tail of the parts is left untouched when they are larger)."""
    copies: list[Copy] = []
    offset = 0
    for addr, length in parts:
        if offset >= num_bytes:
            break
        n = min(length, num_bytes - offset)
        if n:
            copies.append((addr, remote_addr + offset, n))
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
