"""The drain ops on the wire: frames through the master service, decoded by the client's
functions; bad arguments get error replies, never a crash."""

from __future__ import annotations

import pytest

from kvpool.clock import VirtualClock
from kvpool.store.config import ReplicateConfig
from kvpool.store.master.service import MasterService
from kvpool.store.wire.codes import ErrorCode as E
from kvpool.store.wire.codes import ReplicaState
from kvpool.store.wire.drain import plan_from_wire, step_from_wire
from kvpool.store.wire.protocol import Op, decode_reply, encode_request
from tests.store.conftest import KIB, make_core

A = "127.0.0.1:9000"


def call(svc: MasterService, op: Op, *args: object, client: str = "d") -> tuple[int, object]:
    reply = decode_reply(svc.handle(encode_request(op, 1, client, *args)))
    return reply.status, reply.result


def test_a_drain_over_the_wire() -> None:
    svc = MasterService(make_core(VirtualClock()))
    core = svc.core
    (res,) = core.put_start("w", ["k"], [KIB], ReplicateConfig(preferred_segments=(A,)))
    core.put_end("w", ["k"], [42])
    status, wire = call(svc, Op.DRAIN_BEGIN, A, False)
    plan = plan_from_wire(wire)  # type: ignore[arg-type]
    assert status == 0 and plan.code == E.OK and plan.num_objects == 1
    assert plan.segment_ids == (f"{A}/10000",)
    status, wire = call(svc, Op.REPLICATE_START, A, 10, 1 << 20)
    step = step_from_wire(wire)  # type: ignore[arg-type]
    (move,) = step.moves
    assert (move.key, move.size, move.checksum) == ("k", KIB, 42)
    assert [s.endpoint for s in move.sources] == [A] == [r.endpoint for r in res.replicas]
    assert move.target.state == ReplicaState.PENDING and move.target.endpoint != A
    assert call(svc, Op.REPLICATE_END, ["k"], [0]) == (0, [0])
    step = step_from_wire(call(svc, Op.REPLICATE_START, A, 10, 1 << 20)[1])  # type: ignore[arg-type]
    assert step.done and step.code == E.OK
    assert call(svc, Op.DRAIN_END, A) == (0, 0)
    assert call(svc, Op.DRAIN_END, A) == (0, int(E.SEGMENT_NOT_FOUND))
    status, wire = call(svc, Op.REPLICATE_START, A, 10, 1 << 20)
    assert step_from_wire(wire).code == E.SEGMENT_NOT_FOUND  # type: ignore[arg-type]
    assert plan_from_wire(call(svc, Op.DRAIN_BEGIN, "nope:1", True)[1]).code \
        == E.SEGMENT_NOT_FOUND  # type: ignore[arg-type]
    core.check_integrity()


@pytest.mark.parametrize("args", [
    (Op.DRAIN_BEGIN, A),                      # missing dry_run
    (Op.DRAIN_BEGIN, 5, False),
    (Op.REPLICATE_START, A, 0, 100),          # max_keys out of range
    (Op.REPLICATE_START, A, 10, 0),
    (Op.REPLICATE_START, A, 1 << 40, 100),
    (Op.REPLICATE_START, A, "10", 100),
    (Op.REPLICATE_END, ["k"], "0"),
    (Op.DRAIN_END, 7),
])
def test_bad_drain_requests_are_refused(args: tuple[object, ...]) -> None:
    svc = MasterService(make_core(VirtualClock()))
    status, _ = call(svc, *args)  # type: ignore[arg-type]
    assert status == int(E.INVALID_PARAMS)
    svc.core.check_integrity()


def test_bad_values_inside_replicate_end() -> None:
    svc = MasterService(make_core(VirtualClock()))
    assert call(svc, Op.REPLICATE_END, ["k", 5, "x"], [0, 0, "no"]) == \
        (0, [int(E.LEASE_EXPIRED), int(E.INVALID_PARAMS), int(E.INVALID_PARAMS)])
    assert call(svc, Op.REPLICATE_END, ["k"], [0, 0]) == (0, [int(E.INVALID_PARAMS)])
