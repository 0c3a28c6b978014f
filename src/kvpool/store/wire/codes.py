"""Result codes and typed results of the store.

`ErrorCode` values are Mooncake's integer codes, so the compatibility layer can hand them out
unchanged; every result type in the native API carries one (`.code`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NamedTuple


class ErrorCode(enum.IntEnum):
    OK = 0
    INTERNAL_ERROR = -1
    """The master failed to serve a request through no fault of the caller (a bug; its log
    has the traceback)."""
    NO_AVAILABLE_HANDLE = -200
    INVALID_PARAMS = -600
    REPLICA_IS_NOT_READY = -703
    """The object is on disk only and is being copied into DRAM: look it up again shortly
    (the client does, within its RPC timeout)."""
    OBJECT_NOT_FOUND = -704
    OBJECT_ALREADY_EXISTS = -705
    OBJECT_HAS_LEASE = -706
    LEASE_EXPIRED = -707
    TRANSFER_FAIL = -800
    RPC_FAIL = -900
    RPC_TIMEOUT = -901
    UNKNOWN_CLIENT = -1000
    SEGMENT_NOT_FOUND = -1001
    SEGMENT_ALREADY_EXISTS = -1002
    CHECKSUM_MISMATCH = -1003
    """Every replica read (or the only one) did not match the checksum recorded at put_end:
    the bytes are not handed out."""

    @property
    def ok(self) -> bool:
        return self is ErrorCode.OK


class ReplicaState(enum.IntEnum):
    PENDING = 1
    COMPLETE = 2


class Tier(enum.IntEnum):
    DRAM = 1
    SSD = 2


class ReplicaDesc(NamedTuple):
    """Where one replica's bytes live: `endpoint` is the transfer-engine segment name of the
    owner ("host:port"), `addr` an absolute address inside that process's mounted segment.
    (Named tuples: they go on the wire as msgpack arrays without conversion.)"""

    segment_id: str
    endpoint: str
    addr: int
    size: int
    tier: Tier = Tier.DRAM
    state: ReplicaState = ReplicaState.COMPLETE
    fence: int = 0
    """Write fence of the mount the replica lives in: every transfer to or from it carries
    this value, and the owner refuses it once the segment was mounted again (0 = none)."""

    @property
    def host(self) -> str:
        return self.endpoint.rsplit(":", 1)[0]


class PutStartResult(NamedTuple):
    code: ErrorCode
    replicas: tuple[ReplicaDesc, ...] = ()


class Reservation(NamedTuple):
    """Space held for a client's next put (master/reserve.py); `token` names it in
    PUT_COMMIT."""

    code: ErrorCode
    token: str = ""
    replicas: tuple[ReplicaDesc, ...] = ()


class LookupResult(NamedTuple):
    """The answer to a replica lookup; `lease_ttl_s` is how long the read lease lasts."""

    code: ErrorCode
    size: int = 0
    replicas: tuple[ReplicaDesc, ...] = ()
    lease_ttl_s: float = 0.0
    checksum: int | None = None
    """xxh3_64 of the object's bytes recorded at put_end (None: put without one)."""

    def lease_over(self, since: float, now: float) -> bool:
        """Whether the read lease, counted from `since` (before the lookup was asked for),
        has ended by `now`: a replica's bytes read after it may be another object's."""
        return now > since + self.lease_ttl_s


@dataclass(frozen=True, slots=True)
class GetResult:
    """Bytes of an object (`data`), or why there are none (`code`)."""

    code: ErrorCode
    data: bytes = b""

    @property
    def ok(self) -> bool:
        return self.code is ErrorCode.OK


@dataclass(frozen=True, slots=True)
class PutResult:
    """`code` is OK when the object is stored (or already was, for a plain put)."""

    code: ErrorCode
    already_existed: bool = False

    @property
    def ok(self) -> bool:
        return self.code is ErrorCode.OK


@dataclass(frozen=True, slots=True)
class ReadResult:
    """A zero-copy read: bytes written into the caller's buffer, or the failure code."""

    code: ErrorCode
    num_bytes: int = 0

    @property
    def ok(self) -> bool:
        return self.code is ErrorCode.OK

    @property
    def value(self) -> int:
        """Mooncake's convention: bytes read, or a negative code."""
        return self.num_bytes if self.code is ErrorCode.OK else int(self.code)


@dataclass(frozen=True, slots=True)
class SegmentInfo:
    segment_id: str
    client_id: str
    endpoint: str
    base_addr: int
    capacity_bytes: int
    used_bytes: int
    tier: Tier = Tier.DRAM
    draining: bool = False
    """Being drained: takes no new placements."""


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    key: str
    size: int
    replicas: tuple[ReplicaDesc, ...] = field(default_factory=tuple)
    leased: bool = False
    hard_pinned: bool = False
    soft_pinned: bool = False
