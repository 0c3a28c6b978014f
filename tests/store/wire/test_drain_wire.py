"""The drain ops on the wire: frames through the master service, decoded by the client's
functions; bad arguments get error replies, never a crash."""

from __future__ import annotations

import pytest

from kvpool.clock import VirtualClock
from kvpool.store.config import ReplicateConfig
from kvpool.store.master.service import MasterService
from kvpool.store.wire import messages as m
from kvpool.store.wire.codes import ErrorCode as E
from kvpool.store.wire.codes import ReplicaState
from kvpool.store.wire.drain import DrainPlan, DrainStep
from kvpool.store.wire.protocol import Op, decode_reply, decode_reply_head, encode_request
from tests.store.conftest import KIB, make_core

A = "127.0.0.1:9000"


def call(svc: MasterService, op: Op, *args: object, client: str = "d") -> tuple[int, object]:
    """(status, result as plain values) of a request sent with positional fields."""
    reply = decode_reply(svc.handle(encode_request(op, 1, client, *args)))
    return reply.status, reply.result


def typed(svc: MasterService, msg: m.Msg) -> object:
    """The result of a typed request, decoded as the client decodes it (`msg.Reply`)."""
    msg.req_id, msg.client_id = 1, "d"
    head = decode_reply_head(svc.handle(m.encode_msg(msg)))
    assert head.status == 0
    return m.decode_result(type(msg), head.result)


def plan_of(svc: MasterService, address: str, dry_run: bool = False) -> DrainPlan:
    plan = typed(svc, m.DrainBeginMsg(address=address, dry_run=dry_run))
    assert isinstance(plan, DrainPlan)
    return plan


def step_of(svc: MasterService, address: str = A) -> DrainStep:
    step = typed(svc, m.ReplicateStartMsg(address=address, max_keys=10, max_bytes=1 << 20))
    assert isinstance(step, DrainStep)
    return step


def test_a_drain_over_the_wire() -> None:
    svc = MasterService(make_core(VirtualClock()))
    core = svc.core
    (res,) = core.put_start("w", ["k"], [KIB], ReplicateConfig(preferred_segments=(A,)))
    core.put_end("w", ["k"], [42])
    plan = plan_of(svc, A)
    assert plan.code == E.OK and plan.num_objects == 1
    assert plan.segment_ids == (f"{A}/10000",)
    (move,) = step_of(svc).moves
    assert (move.key, move.size, move.checksum) == ("k", KIB, 42)
    assert [s.endpoint for s in move.sources] == [A] == [r.endpoint for r in res.replicas]
    assert move.target.state == ReplicaState.PENDING and move.target.endpoint != A
    assert typed(svc, m.ReplicateEndMsg(keys=["k"], codes=[0])) == [E.OK]
    step = step_of(svc)
    assert step.done and step.code == E.OK
    assert call(svc, Op.DRAIN_END, A) == (0, 0)
    assert typed(svc, m.DrainEndMsg(address=A)) == int(E.SEGMENT_NOT_FOUND)
    assert step_of(svc).code == E.SEGMENT_NOT_FOUND
    assert plan_of(svc, "nope:1", dry_run=True).code == E.SEGMENT_NOT_FOUND
    core.check_integrity()


@pytest.mark.parametrize("args", [
    (Op.DRAIN_BEGIN, A, "yes"),               # dry_run must be a bool
    (Op.DRAIN_BEGIN, 5, False),
    (Op.REPLICATE_START, A, 0, 100),          # max_keys out of range
    (Op.REPLICATE_START, A, 10, 0),
    (Op.REPLICATE_START, A, 1 << 40, 100),
    (Op.REPLICATE_START, A, "10", 100),
    (Op.REPLICATE_END, ["k"], "0"),
    (Op.REPLICATE_END, ["k", 5], [0, 0]),       # keys must be strings
    (Op.DRAIN_END, 7),
])
def test_bad_drain_requests_are_refused(args: tuple[object, ...]) -> None:
    svc = MasterService(make_core(VirtualClock()))
    status, _ = call(svc, *args)  # type: ignore[arg-type]
    assert status == int(E.INVALID_PARAMS)
    svc.core.check_integrity()


def test_bad_values_inside_replicate_end() -> None:
    svc = MasterService(make_core(VirtualClock()))
    assert call(svc, Op.REPLICATE_END, ["k", "x"], [0, 7]) == \
        (0, [int(E.LEASE_EXPIRED), int(E.LEASE_EXPIRED)])
    assert call(svc, Op.REPLICATE_END, ["k"], [0, 0]) == (0, [int(E.INVALID_PARAMS)])
