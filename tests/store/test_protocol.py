"""The wire codec and service: every malformed frame gets an error reply, never a crash."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.clock import VirtualClock
from kvpool.errors import RemoteProtocolError
from kvpool.store.master.service import MasterService
from kvpool.store.wire.codes import ErrorCode as E
from kvpool.store.wire.protocol import Op, decode_reply, decode_request, encode_request
from tests.store.conftest import make_core


def service() -> MasterService:
    return MasterService(make_core(VirtualClock()))


def call(svc: MasterService, frame: bytes) -> tuple[int, int, object]:
    reply = decode_reply(svc.handle(frame))
    return reply.req_id, reply.status, reply.result


def test_round_trip_put_and_get() -> None:
    svc = service()
    frame = encode_request(Op.PUT_START, 5, "w", ["a", "b"], [100, 200], 2, False, False, [],
                           False)
    req_id, status, result = call(svc, frame)
    assert (req_id, status) == (5, 0)
    assert [r[0] for r in result] == [0, 0]                       # type: ignore[index]
    assert len(result[0][1]) == 2                                 # type: ignore[index]
    assert call(svc, encode_request(Op.PUT_END, 6, "w", ["a", "b"])) == (6, 0, [0, 0])
    _, _, got = call(svc, encode_request(Op.GET_REPLICAS, 7, "r", ["a", "zz"]))
    assert got[0] == 10.0                                         # type: ignore[index]
    assert got[1][0][:2] == [0, 100] and got[1][1] == [-704, 0, [], 0.0, None]  # type: ignore[index]
    svc.core.check_integrity()


@pytest.mark.parametrize("frame", [
    b"", b"\xc1", b"\x93\x01", msgpack.packb("text"), msgpack.packb([99, 1, "c"]),
    msgpack.packb([int(Op.EXISTS), 1, "c"]), msgpack.packb([int(Op.EXISTS), 1, "c", "notalist"]),
    msgpack.packb([int(Op.EXISTS), "1", "c", []]), msgpack.packb([int(Op.EXISTS), 1, 2, []]),
    msgpack.packb([int(Op.MOUNT), 1, "c", "h:1", -1.5, 10, 1]),
    msgpack.packb([int(Op.MOUNT), 1, "c", "h:1", 0, 10, 77]),
    msgpack.packb([int(Op.PUT_START), 1, "c", ["k"], [1], 2, False, False, [3], False]),
    msgpack.packb([int(Op.EXISTS), 1, "c", [], 5]),
    b"\x94\x09\x01\xa1c\x91\xa2\xff\xfe",           # invalid UTF-8 inside a key
    msgpack.packb([int(Op.EXISTS), 1, "c", ["k"] * 70000]),
])
def test_malformed_frames_get_invalid_params(frame: bytes) -> None:
    svc = service()
    _, status, message = call(svc, frame)
    assert status == E.INVALID_PARAMS
    assert isinstance(message, str) and message
    assert call(svc, encode_request(Op.PING, 9, "c")) == (9, 0, "pong")


def test_bad_values_inside_well_formed_requests() -> None:
    svc = service()
    keys = ["", "a" * 5000, 17, None, "ok"]
    _, status, result = call(svc, encode_request(Op.PUT_START, 1, "c", keys, [1] * 5, 1, False,
                                                 False, [], False))
    assert status == 0 and [r[0] for r in result] == [-600, -600, -600, -600, 0]  # type: ignore
    _, status, result = call(svc, encode_request(Op.PUT_START, 2, "c", ["x", "y"], [1], 1,
                                                 False, False, [], False))
    assert status == 0 and [r[0] for r in result] == [-600, -600]  # type: ignore[union-attr]
    _, status, result = call(svc, encode_request(Op.PUT_START, 3, "c", ["x"], [1], 0, False,
                                                 False, [], False))
    assert [r[0] for r in result] == [-600]                         # type: ignore[union-attr]
    assert call(svc, encode_request(Op.REMOVE_REGEX, 4, "c", "(", False))[2] == -600
    assert call(svc, encode_request(Op.MOUNT, 5, "c", "h:1", 0, 0, 1))[2] == [-600, ""]
    for frame in (encode_request(Op.PING, 6, ""), encode_request(Op.PING, 6, "a b"),
                  encode_request(Op.PING, 6, "c" * 5000),
                  encode_request(Op.PUT_START, 6, "c", ["k"], [1], 1, False, False,
                                 ["s"] * 65, False),
                  encode_request(Op.REMOVE_REGEX, 6, "c", "a" * 1025, False)):
        assert call(svc, frame)[:2] == (6, E.INVALID_PARAMS)
    assert svc.key_errors[("PUT_START", "INVALID_PARAMS")] == 4 + 2 + 1
    svc.core.check_integrity()


def test_truncated_frames_byte_by_byte() -> None:
    svc = service()
    frame = encode_request(Op.PUT_START, 3, "w", ["key"], [64], 1, False, False, [], False)
    for cut in range(len(frame)):
        with pytest.raises(RemoteProtocolError):
            decode_request(frame[:cut])
        assert call(svc, frame[:cut])[1] == E.INVALID_PARAMS
    assert call(svc, frame)[1] == 0
    assert svc.core.pending.keys() == {"key"}


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64))
def test_fuzz_never_crashes(data: bytes) -> None:
    svc = service()
    req_id, status, _ = call(svc, data)
    assert isinstance(req_id, int) and isinstance(status, int)
    svc.core.check_integrity()


def test_trailing_arguments_of_older_clients_take_their_defaults() -> None:
    assert decode_request(encode_request(Op.MOUNT, 1, "c", "h:1", 4096, 10, 1)).args == (
        "h:1", 4096, 10, 1, 0)
    assert decode_request(encode_request(Op.MOUNT, 1, "c", "h:1", 4096, 10, 1, 7)).args[4] == 7
    assert decode_request(encode_request(Op.PUT_END, 1, "c", ["k"])).args == (["k"], None)
    for frame in (encode_request(Op.MOUNT, 1, "c", "h:1", 4096, 10),
                  encode_request(Op.PUT_END, 1, "c"),
                  encode_request(Op.PUT_END, 1, "c", ["k"], [1], [2]),
                  encode_request(Op.MOUNT, 1, "c", "h:1", 4096, 10, 1, "x")):
        with pytest.raises(RemoteProtocolError):
            decode_request(frame)
    svc = service()
    _, _, (code, sid) = call(svc, encode_request(Op.MOUNT, 2, "n", "h:2", 4096, 4096, 1,
                                                 (1 << 64) - 1))  # type: ignore[misc]
    assert code == 0 and svc.core.segments[sid].fence == (1 << 64) - 1
    svc.core.put_start("w", ["k"], [10])
    assert call(svc, encode_request(Op.PUT_END, 3, "w", ["k"], [(1 << 64) - 1])) == (3, 0, [0])
    assert svc.core.get_replicas(["k"])[0].checksum == (1 << 64) - 1
