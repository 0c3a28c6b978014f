"""Control-plane envelope between store clients and the master (sans-I/O).

One msgpack array per frame:

    request: [op, req_id, client_id, field1, field2, ...]   (fields per op: messages.py)
    reply:   [req_id, status, result]                         (status 0 = OK, else an
                                                               ErrorCode; on error `result`
                                                               is a message)

Every call is batch-shaped where keys are involved, so a batch of keys is one round trip.
The typed request classes, their reply types and the checked decoders live in messages.py;
this module holds the ops and the reply envelope, which the handshake (auth.py) shares.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import msgpack
import msgspec

from kvpool.errors import RemoteProtocolError

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
    SSD_MOUNT = 14
    NODE_TASKS = 15
    NODE_REPORT = 16
    SSD_REGISTER = 17
    DRAIN_BEGIN = 18
    REPLICATE_START = 19
    REPLICATE_END = 20
    DRAIN_END = 21
    PUT_COMMIT = 24
    DROP_DAMAGED = 25


@dataclass(frozen=True, slots=True)
class Reply:
    req_id: int
    status: int
    result: Any


class ReplyHead(msgspec.Struct, array_like=True, forbid_unknown_fields=True, gc=False):
    """A reply whose result is left undecoded (the caller knows its type)."""

    req_id: int
    status: int
    result: msgspec.Raw


_encode = msgspec.msgpack.Encoder().encode
_head_decoder = msgspec.msgpack.Decoder(ReplyHead)
_any_decoder = msgspec.msgpack.Decoder()


def encode_request(op: Op, req_id: int, client_id: str, *args: Any) -> bytes:
    """A raw request with positional fields, unchecked: for tests and tools that speak the
    wire directly (library code sends messages.Msg objects)."""
    return msgpack.packb([int(op), req_id, client_id, *args], use_bin_type=True)


def encode_reply(req_id: int, status: int, result: Any) -> bytes:
    """Named tuples (replicas, results) go as arrays and enums as their integers."""
    return _encode((req_id, status, result))


def _check_size(frame: bytes) -> None:
    if len(frame) > MAX_FRAME_BYTES:
        raise RemoteProtocolError(f"frame of {len(frame)} bytes exceeds {MAX_FRAME_BYTES}")


def decode_reply_head(frame: bytes) -> ReplyHead:
    """The envelope of a reply; RemoteProtocolError when it is malformed."""
    _check_size(frame)
    try:
        return _head_decoder.decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise RemoteProtocolError(f"a reply is an array [req_id, status, result]: {exc}"
                                  ) from None


def decode_reply(frame: bytes) -> Reply:
    """A reply with its result decoded as plain msgpack values (lists, ints, str)."""
    head = decode_reply_head(frame)
    try:
        return Reply(head.req_id, head.status, _any_decoder.decode(head.result))
    except msgspec.DecodeError as exc:  # pragma: no cover - the head decoded it already
        raise RemoteProtocolError(f"undecodable reply result: {exc}") from None


def peek_req_id(frame: bytes) -> int:
    """Best-effort request id of a frame that failed to decode (0 when unknown)."""
    try:
        msg = msgpack.unpackb(frame, raw=False)
        return msg[1] if type(msg) is list and len(msg) > 1 and type(msg[1]) is int else 0
    except Exception:
        return 0
