"""Reserved puts (PUT_COMMIT): the master's rules on a virtual clock, then the client's
fast path against a real master and store node."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvpool.clock import VirtualClock
from kvpool.errors import RpcFailed
from kvpool.store.client.config import ClientConfig
from kvpool.store.client.reserved import MAX_AGE_S, ReservedPuts
from kvpool.store.client.store_client import StoreClient
from kvpool.store.config import ReplicateConfig
from kvpool.store.master.reserve import Reservations
from kvpool.store.master.server import MasterServer
from kvpool.store.master.service import MasterService
from kvpool.store.wire import messages as m
from kvpool.store.wire.codes import ErrorCode as E
from kvpool.store.wire.codes import PutResult, Reservation
from kvpool.store.wire.protocol import decode_reply_head
from tests.store.client.test_client import MIB, start_master
from tests.store.conftest import live_for, make_core


def ask(svc: MasterService, msg: m.Msg, client: str = "w") -> tuple[int, object]:
    msg.req_id, msg.client_id = 1, client
    head = decode_reply_head(svc.handle(m.encode_msg(msg)))
    return head.status, (m.decode_result(type(msg), head.result) if head.status == 0 else None)


def commit(keys: list[str], tokens: list[str], sums: list[int | None] | None = None,
           reserve: list[int] | None = None, upsert: bool = False) -> m.PutCommitMsg:
    return m.PutCommitMsg(keys=keys, tokens=tokens, checksums=sums or [None] * len(keys),
                          upsert=upsert, reserve_sizes=reserve or [])


def reserve(svc: MasterService, size: int, client: str = "w") -> str:
    status, reply = ask(svc, commit([], [], reserve=[size]), client)
    assert status == 0 and isinstance(reply, m.PutCommitReply)
    (held,) = reply.reserved
    assert held.code is E.OK and held.replicas[0].size == size
    return held.token


def test_a_commit_publishes_the_reserved_space_under_its_key(vclock: VirtualClock) -> None:
    svc = MasterService(make_core(vclock))
    token = reserve(svc, 100)
    assert token.startswith("\x00") and token in svc.core.pending
    replica = svc.core.pending[token].replicas[0]
    _, reply = ask(svc, commit(["k"], [token], [42], reserve=[100]))
    assert isinstance(reply, m.PutCommitReply) and reply.codes == [E.OK]
    assert reply.reserved[0].code is E.OK and reply.reserved[0].token != token
    look = svc.core.get_replicas(["k"])[0]
    assert look.code is E.OK and look.checksum == 42 and look.size == 100
    assert look.replicas[0].addr == replica.segment.base_addr + replica.offset
    assert token not in svc.core.pending and len(svc.core.pending) == 1
    svc.core.check_integrity()


def test_what_a_commit_refuses(vclock: VirtualClock) -> None:
    svc = MasterService(make_core(vclock))
    token = reserve(svc, 64)
    svc.core.put_start("w", ["plain"], [64])
    _, reply = ask(svc, commit(["k"], [token]), client="other")      # not its reservation
    _, plain = ask(svc, commit(["k"], ["plain"]))                    # a pending key is no token
    _, elsewhere = ask(svc, commit(["k"], ["\x00" + "f" * 16 + ":1"]))  # another master's
    assert [x.codes for x in (reply, plain, elsewhere)] == [[E.OBJECT_NOT_FOUND]] * 3  # type: ignore[union-attr]
    _, bad = ask(svc, commit(["bad key"], [token]))
    _, mismatched = ask(svc, m.PutCommitMsg(keys=["k"], tokens=[token], checksums=[]))
    assert bad.codes == [E.INVALID_PARAMS] and mismatched.codes == [E.INVALID_PARAMS]  # type: ignore[union-attr]
    assert ask(svc, commit([], [], reserve=[1] * 17))[0] == E.INVALID_PARAMS
    for msg in (m.GetReplicasMsg(keys=[token]), m.ExistsMsg(keys=[token]),
                m.RemoveMsg(keys=[token])):                           # tokens name no object
        assert ask(svc, msg)[1] == ([E.INVALID_PARAMS] if not isinstance(
            msg, m.GetReplicasMsg) else ask(svc, msg)[1])
    assert token in svc.core.pending
    _, ok = ask(svc, commit(["k"], [token]))
    assert ok.codes == [E.OK]                                         # type: ignore[union-attr]
    svc.core.check_integrity()


def test_an_existing_key_keeps_the_reservation_unless_upsert(vclock: VirtualClock) -> None:
    svc = MasterService(make_core(vclock))
    svc.core.put_start("w", ["k"], [64])
    svc.core.put_end("w", ["k"], [1])
    token = reserve(svc, 64)
    _, reply = ask(svc, commit(["k"], [token], [2]))
    assert reply.codes == [E.OBJECT_ALREADY_EXISTS] and token in svc.core.pending  # type: ignore[union-attr]
    assert svc.core.get_replicas(["k"])[0].checksum == 1
    _, reply = ask(svc, commit(["k"], [token], [3], upsert=True))
    assert reply.codes == [E.OK] and svc.core.get_replicas(["k"])[0].checksum == 3  # type: ignore[union-attr]
    svc.core.check_integrity()


def test_unused_reservations_are_discarded_like_pending_puts(vclock: VirtualClock) -> None:
    svc = MasterService(make_core(vclock, put_discard_timeout_s=5.0))
    token = reserve(svc, 64)
    live_for(svc.core, vclock, 10.0)
    assert token not in svc.core.pending
    _, reply = ask(svc, commit(["k"], [token]))
    assert reply.codes == [E.OBJECT_NOT_FOUND] and svc.core.exists(["k"]) == [  # type: ignore[union-attr]
        E.OBJECT_NOT_FOUND]
    svc.core.check_integrity()


def test_a_reservation_takes_free_space_only(vclock: VirtualClock) -> None:
    """A pool full of objects no lease holds: a reservation (space for a put that may not
    come) is refused and evicts nothing; a put that is asked for evicts to make room."""
    svc = MasterService(make_core(vclock, num_segments=1, capacity=64 * 1024))
    core = svc.core
    for i in range(4):
        started = core.put_start_one("w", f"o{i}", 16 * 1024, ReplicateConfig(), False, [],
                                     vclock.now())
        assert started.code is E.OK and core.put_end_one("w", f"o{i}", None) is E.OK
    status, reply = ask(svc, commit([], [], reserve=[16 * 1024]))
    assert status == 0 and isinstance(reply, m.PutCommitReply)
    assert [r.code for r in reply.reserved] == [E.NO_AVAILABLE_HANDLE]
    assert all(f"o{i}" in core.objects for i in range(4))
    assert core.put_start_one("w", "real", 16 * 1024, ReplicateConfig(), False, [],
                              vclock.now()).code is E.OK
    assert sum(f"o{i}" in core.objects for i in range(4)) < 4
    core.check_integrity()


def test_tokens_of_two_masters_differ(vclock: VirtualClock) -> None:
    core = make_core(vclock)
    a, b = Reservations(core), Reservations(core)
    ta, tb = a.reserve("w", 64).token, b.reserve("w", 64).token
    assert ta.split(":")[0] != tb.split(":")[0]


# -- the client's held reservations, on a virtual clock ----------------------------------------

def held_puts(svc: MasterService, vclock: VirtualClock) -> ReservedPuts:
    """The client's reserved-put path against an in-process master; the data plane (writes
    into the reserved replicas) is left out: every copy reports success."""
    def call(msg: m.Msg) -> object:
        status, reply = ask(svc, msg)
        if status:
            raise RpcFailed(E(status))
        return reply
    return ReservedPuts(call, lambda op, copies: set(), lambda replicas, parts, size: [],
                        write_checksums=False, clock=vclock)


def test_held_reservations_age_on_the_clients_clock(vclock: VirtualClock) -> None:
    svc = MasterService(make_core(vclock, put_discard_timeout_s=60.0))
    puts = held_puts(svc, vclock)
    assert puts.put("k0", [(0, 64)], 64, upsert=False) is None  # a size's first: two-phase
    assert puts.put("k1", [(0, 64)], 64, upsert=False) == PutResult(E.OK)
    (next_token,) = puts.held()[64]
    assert next_token in svc.core.pending
    puts.check_integrity()
    vclock.advance(MAX_AGE_S - 0.1)
    assert puts.take_stale() == [] and puts.held() == {64: [next_token]}
    vclock.advance(0.1)
    assert puts.take_stale() == [next_token] and puts.held() == {}
    puts.check_integrity()


def test_the_integrity_check_finds_a_reservation_held_twice(vclock: VirtualClock) -> None:
    svc = MasterService(make_core(vclock))
    puts = held_puts(svc, vclock)
    token = reserve(svc, 64)
    desc = svc.core.pending[token].replicas[0].desc()
    held = [Reservation(E.OK, token, (desc,))]
    puts._keep(64, held)
    puts._keep(64, held)
    with pytest.raises(AssertionError, match="held twice"):
        puts.check_integrity()
    puts.take_stale(0.0)
    puts._keep(32, [Reservation(E.OK, "other", (desc,))])     # a 64-byte replica
    with pytest.raises(AssertionError, match="'other' is not 32 B"):
        puts.check_integrity()


# -- the client --------------------------------------------------------------------------------

@pytest.fixture
def cluster() -> Iterator[tuple[MasterServer, StoreClient, StoreClient]]:
    master = start_master(lease_ttl_s=0.5)
    node = StoreClient(ClientConfig(master=master.address, global_segment_size=8 * MIB,
                                    local_buffer_size=0, heartbeat_interval_s=0.2))
    writer = StoreClient(ClientConfig(master=master.address, local_buffer_size=MIB,
                                      protocol="tcp"))
    yield master, node, writer
    writer.close()
    node.close()
    master.stop()


def _reservations(master: MasterServer) -> list[str]:
    with master.lock:
        return [k for k in master.core.pending if k.startswith("\x00")]


def test_single_key_puts_go_through_reservations(
        cluster: tuple[MasterServer, StoreClient, StoreClient]) -> None:
    master, node, writer = cluster
    assert writer.put("a", b"1" * 5000).ok
    assert _reservations(master) == []                      # a size's first put: two-phase
    assert writer.put("b0", b"0" * 5000).ok
    held = _reservations(master)
    assert len(held) == 1                                  # kept for the next 5000-byte put
    assert writer.put("b", b"2" * 5000).ok and _reservations(master) != held
    assert writer.put("a", b"3" * 5000).already_existed    # nothing changes; space is kept
    assert len(_reservations(master)) == 2                  # ... beside the next one (at most 2)
    assert node.get("a").data == b"1" * 5000 and node.get("b").data == b"2" * 5000
    assert writer.upsert("a", b"4" * 5000).ok and node.get("a").data == b"4" * 5000
    assert writer.put("big", b"5" * (2 * MIB - 1)).ok       # over RESERVE_MAX_BYTES: two-phase
    assert len(_reservations(master)) == 2 and node.get("big").data == b"5" * (2 * MIB - 1)
    with master.lock:
        master.core.check_integrity()
    writer.close()
    assert _reservations(master) == []                      # given back on close


def test_a_lost_reservation_falls_back_to_the_two_phase_put(
        cluster: tuple[MasterServer, StoreClient, StoreClient]) -> None:
    master, node, writer = cluster
    assert writer.put("a0", b"0" * 100).ok and writer.put("a", b"1" * 100).ok
    held = _reservations(master)
    assert len(held) == 1
    with master.lock:                                       # the master forgets it
        assert master.core.put_revoke(writer.client_id, held) == [E.OK]
    assert writer.put("b", b"2" * 100).ok
    assert node.get("b").data == b"2" * 100 and node.get("a").data == b"1" * 100
    off = StoreClient(ClientConfig(master=master.address, local_buffer_size=MIB,
                                   reserved_puts=False))
    try:
        assert off.put("c", b"3" * 100).ok and node.get("c").data == b"3" * 100
        assert not any(k for k in _reservations(master)
                       if master.core.pending[k].client_id == off.client_id)
    finally:
        off.close()


def test_reservations_that_fill_the_pool_are_given_back_for_a_put(
        cluster: tuple[MasterServer, StoreClient, StoreClient]) -> None:
    """Upserts of a few keys cycling through a dozen sizes near 1 MiB, into an 8 MiB node:
    the reservations kept for each size would hold most of the pool; a put that finds no
    space gives this client's back and tries once more, so none fails."""
    master, node, writer = cluster
    sizes = [(600 + 37 * i) * 1024 for i in range(12)]
    for n in range(96):
        size = sizes[n % len(sizes)]
        assert writer.upsert(f"k{n % 4}", bytes([n % 251]) * size).ok, n
    got = node.get("k3")  # the last put (the others may have been evicted for space since)
    assert (got.code, got.data) == (E.OK, bytes([95 % 251]) * sizes[95 % len(sizes)])
    with master.lock:
        master.core.check_integrity()
