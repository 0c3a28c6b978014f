"""The wire codec and service: every malformed frame gets an error reply, never a crash."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.clock import VirtualClock
from kvpool.errors import RemoteProtocolError
from kvpool.store.master.service import MasterService
from kvpool.store.wire import messages as m
from kvpool.store.wire.codes import ErrorCode as E
from kvpool.store.wire.codes import Tier
from kvpool.store.wire.messages import decode_msg
from kvpool.store.wire.protocol import Op, decode_reply, decode_reply_head, encode_request
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
    keys = ["", "a" * 5000, "ok"]
    _, status, result = call(svc, encode_request(Op.PUT_START, 1, "c", keys, [1] * 3, 1, False,
                                                 False, [], False))
    assert status == 0 and [r[0] for r in result] == [-600, -600, 0]  # type: ignore
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
    for keys in (["ok", 17], ["ok", None]):  # a key that is no str: the whole request
        assert call(svc, encode_request(Op.PUT_START, 7, "c", keys, [1, 1], 1, False, False,
                                        [], False))[:2] == (7, E.INVALID_PARAMS)
    assert svc.key_errors[("PUT_START", "INVALID_PARAMS")] == 2 + 2 + 1
    svc.core.check_integrity()


def test_truncated_frames_byte_by_byte() -> None:
    svc = service()
    frame = encode_request(Op.PUT_START, 3, "w", ["key"], [64], 1, False, False, [], False)
    for cut in range(len(frame)):
        with pytest.raises(RemoteProtocolError):
            decode_msg(frame[:cut])
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
    assert decode_msg(encode_request(Op.MOUNT, 1, "c", "h:1", 4096, 10, 1)) == m.MountMsg(
        1, "c", endpoint="h:1", base_addr=4096, size=10, tier=1, fence=0)
    mount = decode_msg(encode_request(Op.MOUNT, 1, "c", "h:1", 4096, 10, 1, 7))
    assert isinstance(mount, m.MountMsg) and mount.fence == 7
    assert decode_msg(encode_request(Op.PUT_END, 1, "c", ["k"])) == m.PutEndMsg(
        1, "c", keys=["k"], checksums=None)
    for frame in (encode_request(Op.MOUNT, 1, "c", "h:1", 4096, 10),
                  encode_request(Op.PUT_END, 1, "c"),
                  encode_request(Op.PUT_END, 1, "c", ["k"], [1], [2]),
                  encode_request(Op.MOUNT, 1, "c", "h:1", 4096, 10, 1, "x")):
        with pytest.raises(RemoteProtocolError):
            decode_msg(frame)
    svc = service()
    _, _, (code, sid) = call(svc, encode_request(Op.MOUNT, 2, "n", "h:2", 4096, 4096, 1,
                                                 (1 << 64) - 1))  # type: ignore[misc]
    assert code == 0 and svc.core.segments[sid].fence == (1 << 64) - 1
    svc.core.put_start("w", ["k"], [10])
    assert call(svc, encode_request(Op.PUT_END, 3, "w", ["k"], [(1 << 64) - 1])) == (3, 0, [0])
    assert svc.core.get_replicas(["k"])[0].checksum == (1 << 64) - 1


TYPED = [
    m.PingMsg(), m.HeartbeatMsg(),
    m.MountMsg(endpoint="h:1", base_addr=4096, size=1 << 20, tier=1, fence=(1 << 64) - 1),
    m.UnmountMsg(segment_id="s"),
    m.PutStartMsg(keys=["a", "b"], sizes=[1, 2], replica_num=2, hard_pin=True, soft_pin=True,
                  preferred=["s"], upsert=True),
    m.PutEndMsg(keys=["a"], checksums=[None]), m.PutEndMsg(keys=["a"], checksums=[7]),
    m.PutRevokeMsg(keys=["a"]), m.GetReplicasMsg(keys=["a"]), m.ExistsMsg(keys=[]),
    m.RemoveMsg(keys=["a"], force=True), m.RemoveAllMsg(force=True),
    m.RemoveRegexMsg(pattern="a.*"), m.SegmentsMsg(),
    m.DrainBeginMsg(address="h:1", dry_run=True),
    m.ReplicateStartMsg(address="h:1", max_keys=8, max_bytes=1 << 20),
    m.ReplicateEndMsg(keys=["a"], codes=[0]), m.DrainEndMsg(address="h:1"),
    m.PutCommitMsg(keys=["a"], tokens=["\x00t:1"], checksums=[None], upsert=True,
                   reserve_sizes=[4096]),
]


@pytest.mark.parametrize("msg", TYPED, ids=lambda msg: type(msg).__name__)
def test_every_message_round_trips_and_truncations_are_refused(msg: m.Msg) -> None:
    msg.req_id, msg.client_id = 11, "w"
    frame = m.encode_msg(msg)
    assert decode_msg(frame) == msg and msg.op is m.MESSAGES[msg.op].op
    assert frame == encode_request(msg.op, 11, "w", *(getattr(msg, f) for f in
                                                      msg.__struct_fields__[2:]))
    for cut in range(len(frame)):
        with pytest.raises(RemoteProtocolError):
            decode_msg(frame[:cut])


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(list(Op)), st.lists(st.one_of(
    st.none(), st.booleans(), st.integers(-(1 << 63), (1 << 64) - 1), st.floats(),
    st.text(max_size=4), st.lists(st.one_of(st.text(max_size=3), st.integers(0, 9),
                                            st.none()), max_size=3)), max_size=9))
def test_fuzz_typed_fields_either_decode_or_get_invalid_params(op: Op, args: list) -> None:  # type: ignore[type-arg]
    """Well-framed requests with random field values: a decoded message has exactly the
    declared types, anything else is INVALID_PARAMS; the core stays consistent."""
    frame = encode_request(op, 3, "c", *args)
    try:
        msg = decode_msg(frame)
    except RemoteProtocolError:
        msg = None
    if msg is not None:
        assert type(msg) is m.MESSAGES[op] and msg.op is op
        assert m.encode_msg(msg) == msgpack.packb([int(op), 3, "c", *args]) or \
            len(args) < len(msg.__struct_fields__) - 2  # trailing defaults filled in
    svc = service()
    req_id, status, _ = call(svc, frame)
    assert req_id == 3 and (msg is not None or status == E.INVALID_PARAMS)
    svc.core.check_integrity()


def test_typed_results_are_checked_against_the_reply_type() -> None:
    svc = service()
    segment = next(iter(svc.core.segments.values()))
    for msg in (m.PutStartMsg(keys=["k"], sizes=[10]), m.PutEndMsg(keys=["k"], checksums=[5]),
                m.GetReplicasMsg(keys=["k", "x"]), m.SegmentsMsg()):
        msg.req_id, msg.client_id = 1, "w"
        head = decode_reply_head(svc.handle(m.encode_msg(msg)))
        result = m.decode_result(type(msg), head.result)
        if isinstance(msg, m.PutStartMsg):
            assert result[0].code is E.OK and result[0].replicas[0].addr >= segment.base_addr
        elif isinstance(msg, m.GetReplicasMsg):
            assert [x.code for x in result.items] == [E.OK, E.OBJECT_NOT_FOUND]
            assert result.items[0].checksum == 5 and result.items[0].replicas[0].tier is Tier.DRAM
        elif isinstance(msg, m.SegmentsMsg):
            assert result[0].segment_id == segment.segment_id
    for cls, bad in ((m.PutEndMsg, [99]), (m.PutStartMsg, [[0, [["s", "h:1", 1, 2, 9, 1, 0]]]]),
                     (m.GetReplicasMsg, [1.0]), (m.MountMsg, [0]), (m.PingMsg, 1)):
        with pytest.raises(RemoteProtocolError):
            m.decode_result(cls, msgpack.packb(bad))
