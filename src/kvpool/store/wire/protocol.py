"""Control-plane wire protocol between store clients and the master (sans-I/O).

One msgpack array per frame:

    request: [op, req_id, client_id, arg1, arg2, ...]   (args per op, see REQUESTS)
    reply:   [req_id, status, result]                    (status 0 = OK, else an ErrorCode;
                                                          on error `result` is a message)

Every call is batch-shaped where keys are involved, so a batch of keys is one round trip.
Decoding checks the op, the arity and the type of every argument; anything else raises
RemoteProtocolError, which the server turns into an INVALID_PARAMS reply.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack

from kvpool.errors import RemoteProtocolError
from kvpool.store.wire.codes import ReplicaDesc, ReplicaState, Tier

MAX_FRAME_BYTES = 64 << 20


class Op(enum.IntEnum):
    PING = 1
    HEARTBEAT = 2
    MOUNT = 3
    UNMOUNT = 4
    PUT_START = 5
    PUT_END = 6
    PUT_REVOKE = 7
    GET_REPLICAS = 8
    EXISTS = 9
    REMOVE = 10
    REMOVE_ALL = 11
    REMOVE_REGEX = 12
    SEGMENTS = 13
    DRAIN_BEGIN = 14
    REPLICATE_START = 15
    REPLICATE_END = 16
    DRAIN_END = 17


def _is_int(v: object) -> bool:
    return type(v) is int


def _is_str(v: object) -> bool:
    return type(v) is str


def _is_bool(v: object) -> bool:
    return type(v) is bool


def _is_list(v: object) -> bool:
    return type(v) is list


def _is_str_list(v: object) -> bool:
    return type(v) is list and all(type(x) is str for x in v)


Check = Callable[[object], bool]

REQUESTS: dict[Op, tuple[tuple[str, Check], ...]] = {
    Op.PING: (),
    Op.HEARTBEAT: (),
    Op.MOUNT: (("endpoint", _is_str), ("base_addr", _is_int), ("size", _is_int),
               ("tier", _is_int), ("fence", _is_int)),
    Op.UNMOUNT: (("segment_id", _is_str),),
    Op.PUT_START: (("keys", _is_list), ("sizes", _is_list), ("replica_num", _is_int),
                   ("hard_pin", _is_bool), ("soft_pin", _is_bool),
                   ("preferred", _is_str_list), ("upsert", _is_bool)),
    Op.PUT_END: (("keys", _is_list), ("checksums", _is_list)),
    Op.PUT_REVOKE: (("keys", _is_list),),
    Op.GET_REPLICAS: (("keys", _is_list),),
    Op.EXISTS: (("keys", _is_list),),
    Op.REMOVE: (("keys", _is_list), ("force", _is_bool)),
    Op.REMOVE_ALL: (("force", _is_bool),),
    Op.REMOVE_REGEX: (("pattern", _is_str), ("force", _is_bool)),
    Op.SEGMENTS: (),
    Op.DRAIN_BEGIN: (("address", _is_str), ("dry_run", _is_bool)),
    Op.REPLICATE_START: (("address", _is_str), ("max_keys", _is_int), ("max_bytes", _is_int)),
    Op.REPLICATE_END: (("keys", _is_list), ("codes", _is_list)),
    Op.DRAIN_END: (("address", _is_str),),
}


OPTIONAL: dict[Op, tuple[Any, ...]] = {
    Op.MOUNT: (0,),
    Op.PUT_END: (None,),
}
"""Defaults of trailing arguments a request may leave out (older clients): a MOUNT without
a fence is unfenced (0); PUT_END without checksums publishes objects that readers cannot
verify."""


@dataclass(frozen=True, slots=True)
class Request:
    op: Op
    req_id: int
    client_id: str
    args: tuple[Any, ...]


@dataclass(frozen=True, slots=True)
class Reply:
    req_id: int
    status: int
    result: Any


def encode_request(op: Op, req_id: int, client_id: str, *args: Any) -> bytes:
    return msgpack.packb([int(op), req_id, client_id, *args], use_bin_type=True)


def _unpack(frame: bytes) -> Any:
    if len(frame) > MAX_FRAME_BYTES:
        raise RemoteProtocolError(f"frame of {len(frame)} bytes exceeds {MAX_FRAME_BYTES}")
    try:
        return msgpack.unpackb(frame, raw=False, use_list=True, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise RemoteProtocolError(f"undecodable frame ({len(frame)} bytes): {exc}") from None


def peek_req_id(frame: bytes) -> int:
    """Best-effort request id of a frame that failed to decode (0 when unknown)."""
    try:
        msg = msgpack.unpackb(frame, raw=False)
        return msg[1] if type(msg) is list and len(msg) > 1 and type(msg[1]) is int else 0
    except Exception:
        return 0


def decode_request(frame: bytes) -> Request:
    msg = _unpack(frame)
    if type(msg) is not list or len(msg) < 3:
        raise RemoteProtocolError("a request is an array [op, req_id, client_id, args...]")
    op_code, req_id, client_id, *args = msg
    try:
        op = Op(op_code)
    except ValueError:
        raise RemoteProtocolError(f"unknown op {op_code!r}") from None
    if type(req_id) is not int or type(client_id) is not str:
        raise RemoteProtocolError("req_id must be an int and client_id a str")
    spec = REQUESTS[op]
    defaults = OPTIONAL.get(op, ())
    if not len(spec) - len(defaults) <= len(args) <= len(spec):
        raise RemoteProtocolError(f"{op.name} takes {len(spec)} arguments, got {len(args)}")
    for (name, check), value in zip(spec, args, strict=False):
        if not check(value):
            raise RemoteProtocolError(f"{op.name}: bad {name} of type {type(value).__name__}")
    if len(args) < len(spec):
        args += defaults[len(defaults) - (len(spec) - len(args)):]
    return Request(op, req_id, client_id, tuple(args))


def encode_reply(req_id: int, status: int, result: Any) -> bytes:
    return msgpack.packb([req_id, status, result], use_bin_type=True)


def decode_reply(frame: bytes) -> Reply:
    msg = _unpack(frame)
    if type(msg) is not list or len(msg) != 3 or type(msg[0]) is not int \
            or type(msg[1]) is not int:
        raise RemoteProtocolError("a reply is an array [req_id, status, result]")
    return Reply(msg[0], msg[1], msg[2])


_TIERS = {int(t): t for t in Tier}
_STATES = {int(s): s for s in ReplicaState}


def replica_from_wire(w: list[Any]) -> ReplicaDesc:
    """Replicas travel as the ReplicaDesc tuple itself: [segment_id, endpoint, addr, size,
    tier, state, fence]. (Dict lookups: calling an IntEnum costs a microsecond per field.)"""
    return tuple.__new__(ReplicaDesc, (w[0], w[1], w[2], w[3], _TIERS[w[4]], _STATES[w[5]],
                                       w[6]))
