"""The master's control-plane messages: one typed class per request, with its reply type
(sans-I/O; the client and the master both import this module, nothing else defines the
schema).

A request travels as one msgpack array whose first element is the op (the class's tag):

    [op, req_id, client_id, field1, field2, ...]      fields in class order

and its reply as [req_id, status, result] (protocol.py): `result` has the class's
`Reply` type when status is 0, else it is a message (str).

Decoding (msgspec, in C) checks the op, the arity and the type of every field, nested lists
included; anything else raises RemoteProtocolError, which the server answers with
INVALID_PARAMS. Values that are well typed but unacceptable (an empty key, a size over the
limit) are judged by the master per key.

Backward compatibility: trailing fields with a default may be left out by older clients
(MOUNT without `fence`, PUT_END without `checksums`). The header fields `req_id` and
`client_id` have defaults only so that callers can build a message before the RPC client
stamps it; the master refuses an empty client_id, so a request without a header is refused.

Adding an op: a subclass of Msg here (tag = a new Op value, fields in wire order, `Reply`),
a handler in master/service.py, and a call `rpc.call(NewMsg(...))` in the client.
"""

from __future__ import annotations

from typing import Any, ClassVar, NamedTuple, Union

import msgspec

from kvpool.errors import RemoteProtocolError
from kvpool.store.wire.codes import ErrorCode, LookupResult, PutStartResult, Reservation
from kvpool.store.wire.drain import DrainPlan, DrainStep
from kvpool.store.wire.protocol import MAX_FRAME_BYTES, Op


class Msg(msgspec.Struct, array_like=True, forbid_unknown_fields=True, gc=False):
    """Base of every request. The RPC client fills in the header (`req_id`, `client_id`)."""

    req_id: int = 0
    client_id: str = ""
    Reply: ClassVar[Any] = Any
    """Type of the result of a successful reply (decoded and checked by the client)."""
    op: ClassVar[Op]
    """The class's tag as an Op (set below, for every class in MESSAGES)."""


class MountReply(msgspec.Struct, array_like=True, frozen=True, gc=False):
    code: int
    segment_id: str


class GetReplicasReply(msgspec.Struct, array_like=True, frozen=True, gc=False):
    lease_ttl_s: float
    items: list[LookupResult]


class PutCommitReply(msgspec.Struct, array_like=True, frozen=True, gc=False):
    codes: list[ErrorCode]
    """Per key of the commit."""
    reserved: list[Reservation]
    """Per size asked for, the space held for a next put."""


class SegmentRow(msgspec.Struct, array_like=True, frozen=True, gc=False):
    segment_id: str
    client_id: str
    endpoint: str
    base_addr: int
    capacity_bytes: int
    used_bytes: int
    tier: int


class PingMsg(Msg, tag=int(Op.PING), kw_only=True):
    Reply: ClassVar[Any] = str


class HeartbeatMsg(Msg, tag=int(Op.HEARTBEAT), kw_only=True):
    """Answer: OK, or UNKNOWN_CLIENT when the master forgot this client (mount again)."""

    Reply: ClassVar[Any] = int


class MountMsg(Msg, tag=int(Op.MOUNT), kw_only=True):
    endpoint: str
    base_addr: int
    size: int
    tier: int
    fence: int = 0
    """Write fence of the memory (0: unfenced, as older clients that omit it)."""
    Reply: ClassVar[Any] = MountReply


class UnmountMsg(Msg, tag=int(Op.UNMOUNT), kw_only=True):
    segment_id: str
    Reply: ClassVar[Any] = int


class PutStartMsg(Msg, tag=int(Op.PUT_START), kw_only=True):
    keys: list[str]
    sizes: list[int]
    replica_num: int = 1
    hard_pin: bool = False
    soft_pin: bool = False
    preferred: list[str] = msgspec.field(default_factory=list)
    upsert: bool = False
    Reply: ClassVar[Any] = list[PutStartResult]


class PutEndMsg(Msg, tag=int(Op.PUT_END), kw_only=True):
    keys: list[str]
    checksums: list[int | None] | None = None
    """xxh3_64 per key (None: older clients; readers cannot verify such objects)."""
    Reply: ClassVar[Any] = list[ErrorCode]


class PutRevokeMsg(Msg, tag=int(Op.PUT_REVOKE), kw_only=True):
    keys: list[str]
    Reply: ClassVar[Any] = list[ErrorCode]


class GetReplicasMsg(Msg, tag=int(Op.GET_REPLICAS), kw_only=True):
    """Replica lookups; each found object gets a read lease."""

    keys: list[str]
    Reply: ClassVar[Any] = GetReplicasReply


class ExistsMsg(Msg, tag=int(Op.EXISTS), kw_only=True):
    keys: list[str]
    Reply: ClassVar[Any] = list[ErrorCode]


class RemoveMsg(Msg, tag=int(Op.REMOVE), kw_only=True):
    keys: list[str]
    force: bool = False
    Reply: ClassVar[Any] = list[ErrorCode]


class RemoveAllMsg(Msg, tag=int(Op.REMOVE_ALL), kw_only=True):
    force: bool = False
    Reply: ClassVar[Any] = int


class RemoveRegexMsg(Msg, tag=int(Op.REMOVE_REGEX), kw_only=True):
    pattern: str
    force: bool = False
    Reply: ClassVar[Any] = int


class SegmentsMsg(Msg, tag=int(Op.SEGMENTS), kw_only=True):
    Reply: ClassVar[Any] = list[SegmentRow]


# -- the disk tier (store/master/tiering.py, store/node/ssd_worker.py) ----------------------


class NodeTask(NamedTuple):
    """One task of a node's disk tier: OFFLOAD the DRAM range to a file, LOAD the file into
    the DRAM range, or DELETE the file (kinds in store/master/tier_tasks.py)."""

    task_id: int
    kind: int
    key: str
    endpoint: str
    addr: int
    size: int
    checksum: int | None
    gen: int
    fence: int


class NodeTasksReply(msgspec.Struct, array_like=True, frozen=True, gc=False):
    code: int
    """OK, or SEGMENT_NOT_FOUND: the master forgot this disk (attach it again)."""
    tasks: list[NodeTask]


class SsdMountMsg(Msg, tag=int(Op.SSD_MOUNT), kw_only=True):
    """Attach (or keep) the sender's disk tier of `size` bytes."""

    endpoint: str
    size: int
    promote_after: int
    Reply: ClassVar[Any] = MountReply


class NodeTasksMsg(Msg, tag=int(Op.NODE_TASKS), kw_only=True):
    """The tasks due for the disk tier `segment_id` (polled by its node), after applying
    `outcomes` of earlier ones as NodeReportMsg does (one round trip per batch)."""

    segment_id: str
    outcomes: list[tuple[int, int]] = []
    Reply: ClassVar[Any] = NodeTasksReply


class NodeReportMsg(Msg, tag=int(Op.NODE_REPORT), kw_only=True):
    """Outcomes of tasks: (task_id, DONE | FAILED | FILE_BAD)."""

    segment_id: str
    outcomes: list[tuple[int, int]]
    Reply: ClassVar[Any] = int


class SsdRegisterMsg(Msg, tag=int(Op.SSD_REGISTER), kw_only=True):
    """Files a node found on its disk at start: the master adopts or refuses each."""

    segment_id: str
    keys: list[str]
    sizes: list[int]
    checksums: list[int]
    gens: list[int]
    Reply: ClassVar[Any] = list[ErrorCode]


class DrainBeginMsg(Msg, tag=int(Op.DRAIN_BEGIN), kw_only=True):
    """Mark the segments of `address` (an endpoint or a segment id) draining and plan; with
    `dry_run` only plan (store/wire/drain.py)."""

    address: str
    dry_run: bool = False
    Reply: ClassVar[Any] = DrainPlan


class ReplicateStartMsg(Msg, tag=int(Op.REPLICATE_START), kw_only=True):
    """The next batch of moves of a drain: at most `max_keys` objects, `max_bytes` bytes."""

    address: str
    max_keys: int
    max_bytes: int
    Reply: ClassVar[Any] = DrainStep


class ReplicateEndMsg(Msg, tag=int(Op.REPLICATE_END), kw_only=True):
    """Per key, 0: the target holds the verified bytes; else why the copy failed."""

    keys: list[str]
    codes: list[int]
    Reply: ClassVar[Any] = list[ErrorCode]


class DrainEndMsg(Msg, tag=int(Op.DRAIN_END), kw_only=True):
    """Stop draining `address` (its segments take placements again)."""

    address: str
    Reply: ClassVar[Any] = int


class PutCommitMsg(Msg, tag=int(Op.PUT_COMMIT), kw_only=True):
    """Publish puts written to reserved space (key i from reservation tokens[i], checksum
    i), then reserve space for the next puts of `reserve_sizes` (master/reserve.py). With
    no keys, only reserves."""

    keys: list[str]
    tokens: list[str]
    checksums: list[int | None]
    upsert: bool = False
    reserve_sizes: list[int] = msgspec.field(default_factory=list)
    Reply: ClassVar[Any] = PutCommitReply


class DropDamagedMsg(Msg, tag=int(Op.DROP_DAMAGED), kw_only=True):
    """Per key, a replica whose bytes failed the checksum a lookup gave (`checksums[i]`): the
    master drops it, or the whole object when no other replica is left (master/damage.py)."""

    keys: list[str]
    segment_ids: list[str]
    addrs: list[int]
    checksums: list[int]
    Reply: ClassVar[Any] = list[ErrorCode]


_CLASSES: tuple[type[Msg], ...] = (
    PingMsg, HeartbeatMsg, MountMsg, UnmountMsg, PutStartMsg, PutEndMsg, PutRevokeMsg,
    GetReplicasMsg, ExistsMsg, RemoveMsg, RemoveAllMsg, RemoveRegexMsg, SegmentsMsg,
    SsdMountMsg, NodeTasksMsg, NodeReportMsg, SsdRegisterMsg,
    DrainBeginMsg, ReplicateStartMsg, ReplicateEndMsg, DrainEndMsg, PutCommitMsg,
    DropDamagedMsg)
MESSAGES: dict[Op, type[Msg]] = {Op(int(c.__struct_config__.tag or 0)): c for c in _CLASSES}
"""Every request class by op (a new op must be listed here)."""
for _op, _cls in MESSAGES.items():
    _cls.op = _op

_encode = msgspec.msgpack.Encoder().encode
_request_decoder = msgspec.msgpack.Decoder(Union[tuple(MESSAGES.values())])  # noqa: UP007
_REPLY_CLASSES: tuple[type[Msg], ...] = (Msg, *_CLASSES)
_result_decoders: dict[type[Msg], msgspec.msgpack.Decoder[Any]] = {
    cls: msgspec.msgpack.Decoder(cls.Reply) for cls in _REPLY_CLASSES}


def encode_msg(msg: Msg) -> bytes:
    return _encode(msg)


def decode_msg(frame: bytes) -> Msg:
    """The request in `frame`; RemoteProtocolError for anything malformed."""
    if len(frame) > MAX_FRAME_BYTES:
        raise RemoteProtocolError(f"frame of {len(frame)} bytes exceeds {MAX_FRAME_BYTES}")
    try:
        msg: Msg = _request_decoder.decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise RemoteProtocolError(f"malformed request ({len(frame)} bytes): {exc}") from None
    return msg


def decode_result(cls: type[Msg], raw: bytes | msgspec.Raw) -> Any:
    """The result of a successful reply to a `cls` request, checked against `cls.Reply`;
    RemoteProtocolError when it does not fit."""
    try:
        return _result_decoders[cls].decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise RemoteProtocolError(f"malformed {cls.__name__} reply: {exc}") from None

