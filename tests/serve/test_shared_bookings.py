"""The bookings of `kvpool proxy --workers N` shared between its processes: a booking on one
process's view queues on the same workers in the other's, over real Unix datagram sockets, and
is released by the same events; a silent or restarted peer's bookings are released; a
malformed datagram is counted and changes nothing."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest

from kvpool.clock import VirtualClock
from kvpool.conductor import Accepted, Conductor, ConductorConfig, RequestInfo
from kvpool.serve.cluster import LiveCluster
from kvpool.serve.peer_link import PeerLink, peer_socket
from kvpool.serve.shared_bookings import SILENT_S, SharedBookings
from tests.conductor.conftest import SIMPLE_COST
from tests.serve.test_cluster import D1, P1, P2, info, two_prefill_one_decode

D2 = "http://d2"

live = two_prefill_one_decode


def book(c: LiveCluster, rid: int, now: float = 0.0) -> object:
    decision = Conductor(ConductorConfig(block_size=4), SIMPLE_COST).schedule(
        RequestInfo(rid, 100, 4, ()), c.view, now)
    assert isinstance(decision, Accepted)
    return c.book(RequestInfo(rid, 100, 4, ()), decision, now)


@contextlib.asynccontextmanager
async def linked(folder: Path, clock: VirtualClock) -> AsyncIterator[
        tuple[LiveCluster, LiveCluster, PeerLink, PeerLink]]:
    """Two processes' views, each told the other's bookings over real sockets in `folder`."""
    a, b = live(clock), live(clock)
    la, lb = PeerLink.attach(a, folder, 0, 2, clock), PeerLink.attach(b, folder, 1, 2, clock)
    la.start()
    lb.start()
    try:
        yield a, b, la, lb
    finally:
        await la.stop()
        await lb.stop()


async def settle(*links: PeerLink) -> None:
    for _ in range(20):  # the datagrams are read on the loop's next turns
        await asyncio.sleep(0.005)


def test_a_booking_on_one_process_is_seen_by_the_other(tmp_path: Path,
                                                        vclock: VirtualClock) -> None:
    async def run() -> None:
        async with linked(tmp_path, vclock) as (a, b, la, lb):
            booking = book(a, 1)
            await settle(la, lb)
            p_a = [p.busy_until_s for p in a.view.prefill]
            assert [p.busy_until_s for p in b.view.prefill] == p_a and max(p_a) > 0
            assert [p.num_queued for p in b.view.prefill] == [p.num_queued
                                                              for p in a.view.prefill]
            assert b.view.decode[0].num_assigned == 1 and b.view.decode[0].assigned_tokens == 100
            assert lb.shared.num_remote() == 1
            # b's own next request goes to the other prefill worker: it sees the queue
            mine = book(b, 1)
            assert mine.prefill.url != booking.prefill.url  # type: ignore[attr-defined]
            vclock.advance(0.5)
            a.decode_start(booking, vclock.now())  # type: ignore[arg-type]
            a.finish(booking, vclock.now())  # type: ignore[arg-type]
            await settle(la, lb)
            assert b.view.decode[0].num_assigned == 1  # b's own request only
            assert lb.shared.num_remote() == 0 and la.shared.num_remote() == 1
            assert lb.shared.num_bad == 0 and la.num_unsent == 0

    asyncio.run(run())


def test_a_silent_peers_bookings_are_released(tmp_path: Path, vclock: VirtualClock) -> None:
    async def run() -> None:
        async with linked(tmp_path, vclock) as (a, b, la, lb):
            book(a, 1)
            book(a, 2)
            await settle(la, lb)
            assert sum(p.num_queued for p in b.view.prefill) == 2
            await la.stop()  # process 0 dies: nothing more from it
            vclock.advance(SILENT_S + 0.1)
            lb.shared.expire(vclock.now())
            assert sum(p.num_queued for p in b.view.prefill) == 0
            assert b.view.decode[0].num_assigned == 0 and lb.shared.num_remote() == 0

    asyncio.run(run())


def test_a_restarted_peers_old_bookings_are_released(vclock: VirtualClock) -> None:
    a, b = live(vclock), live(vclock)
    old, new = SharedBookings(a, 0, 111), SharedBookings(a, 0, 222)
    sb = SharedBookings(b, 1, 333)
    a.sink = old
    book(a, 1)
    for msg in old.outbox:
        sb.apply(msg, 0.0)
    assert sb.num_remote() == 1
    new.heartbeat()  # the same index, another incarnation
    sb.apply(new.outbox[0], 1.0)
    assert sb.num_remote() == 0 and sum(p.num_queued for p in b.view.prefill) == 0


def test_a_lost_finish_is_released_by_the_next_heartbeat(vclock: VirtualClock) -> None:
    """Datagrams to a busy process can be dropped (its queue holds a handful): the next
    heartbeat lists the peer's open bookings, and one it no longer lists is released."""
    a, b = live(vclock), live(vclock)
    sa, sb = SharedBookings(a, 0, 111), SharedBookings(b, 1, 333)
    a.sink = sa
    first, second = book(a, 1), book(a, 2)
    a.finish(first, 0.5)  # type: ignore[arg-type]
    sent, sa.outbox = sa.outbox, []
    for msg in sent[:-1]:  # the "f" of request 1 is lost on the way
        sb.apply(msg, 0.5)
    assert sb.num_remote() == 2
    sa.heartbeat()
    sb.apply(sa.outbox.pop(), 1.0)
    assert sb.num_remote() == 1 and sum(p.num_queued for p in b.view.prefill) == 1
    a.finish(second, 1.5)  # type: ignore[arg-type]
    sa.heartbeat()
    for msg in sa.outbox:
        sb.apply(msg, 2.0)
    assert sb.num_remote() == 0 and b.view.decode[0].num_assigned == 0


@pytest.mark.parametrize("raw", [b"", b"\xc1", b"\x93\xa1b\x00\x01", b"\x93\xa1z\x00\x01",
                                 b"\x94\xa1b\x00\x01\xa1x"])
def test_a_malformed_datagram_is_counted_and_changes_nothing(raw: bytes,
                                                             vclock: VirtualClock) -> None:
    b = live(vclock)
    sb = SharedBookings(b, 1, 1)
    sb.apply(raw, 0.0)
    assert sb.num_bad == 1 and sb.num_remote() == 0
    assert sum(p.num_queued for p in b.view.prefill) == 0


_ENC = msgspec.msgpack.Encoder().encode


@pytest.mark.parametrize("fields", [
    [5, P1, D1, 100, 4, 0, 0, 0.0, float("nan"), 0.01],   # would leave the queue NaN for good
    [5, P1, D1, 100, 4, 0, 0, 0.0, float("inf"), 0.01],
    [5, P1, D1, 100, 4, 0, 0, -1.0, 0.1, 0.01],
    [5, P1, D1, -100, 4, 0, 0, 0.0, 0.1, 0.01],
])
def test_a_booking_whose_numbers_are_out_of_range_is_dropped(fields: list[object],
                                                            vclock: VirtualClock) -> None:
    b = live(vclock)
    sb = SharedBookings(b, 1, 1)
    sb.apply(_ENC(["b", 0, 7, *fields]), 0.0)
    sb.apply(_ENC(["p", 0, 7, float("inf")]), 0.0)  # int(inf): OverflowError, counted too
    assert sb.num_bad == 2 and sb.num_remote() == 0
    assert all(p.busy_until_s == 0.0 for p in b.view.prefill)


def test_a_booking_told_twice_is_booked_once(vclock: VirtualClock) -> None:
    b = live(vclock)
    sb = SharedBookings(b, 1, 1)
    booked = _ENC(["b", 0, 7, 5, P1, D1, 100, 4, 0, 0, 0.0, 0.1, 0.01, None])
    sb.apply(booked, 0.0)
    sb.apply(booked, 0.0)
    sb.apply(_ENC(["f", 0, 7, 5]), 1.0)
    assert sb.num_bad == 1 and b.view.decode[0].num_assigned == 0  # nothing orphaned


def test_a_peer_queues_a_booking_as_the_booking_process_did(vclock: VirtualClock) -> None:
    """The second request queues behind the first on the same prefill worker: every view
    predicts the same decode start for it (early rejection counts it in the same window)."""
    a, b = live(vclock), live(vclock)
    b.withdraw(P2, "in this test")  # one prefill worker in both views: both queue there
    a.withdraw(P2, "in this test")
    sa, sb = SharedBookings(a, 0, 1), SharedBookings(b, 1, 2)
    a.sink = sa
    book(a, 1)
    book(a, 2)
    for msg in sa.outbox:
        sb.apply(msg, 0.0)
    mine = sorted(a.view.decode[0].planned.values())
    assert sorted(b.view.decode[0].planned.values()) == mine and mine[0][0] < mine[1][0]
    assert b.view.prefill[0].busy_until_s == a.view.prefill[0].busy_until_s


def test_a_booking_on_workers_this_view_lacks_is_not_booked(vclock: VirtualClock) -> None:
    a, b = live(vclock), live(vclock)
    b.withdraw(P1, "in this test")
    b.withdraw(P2, "in this test")
    b.add(P2)
    b.join(P2, info("prefill"))
    sa = SharedBookings(a, 0, 1)
    a.sink = sa
    placed = book(a, 1)
    sb = SharedBookings(b, 1, 2)
    for msg in sa.outbox:
        sb.apply(msg, 0.0)
    held = sb.num_remote()
    assert held == (1 if placed.prefill.url == P2 else 0)  # type: ignore[attr-defined]
    assert sb.num_bad == 0


def test_a_decode_moved_on_one_process_moves_in_the_others_view(vclock: VirtualClock) -> None:
    """A decode leg resumed on another worker: the other process's view moves the booking's
    decode load there too, and its finish releases it there; a view without that worker
    releases the booking (it cannot queue it where it went)."""
    def with_two_decoders() -> LiveCluster:
        c = live(vclock)
        c.add(D2)
        c.join(D2, info("decode"))
        return c
    a, b, short = with_two_decoders(), with_two_decoders(), live(vclock)
    sa, sb, ss = SharedBookings(a, 0, 1), SharedBookings(b, 1, 2), SharedBookings(short, 2, 3)
    a.sink = sa
    placed = book(a, 1)
    a.decode_start(placed, 0.5)  # type: ignore[arg-type]
    first, other = D1, D2
    assert placed.decode.url == first  # type: ignore[attr-defined]  # the view's first
    for msg in sa.outbox:
        sb.apply(msg, 0.5)
        ss.apply(msg, 0.5)
    assert sb.num_remote() == ss.num_remote() == 1  # both views hold it (on d1)
    sa.outbox.clear()
    a.move_decode(placed, a.workers[other], 1.0)  # type: ignore[arg-type]
    for msg in sa.outbox:
        sb.apply(msg, 1.0)
        ss.apply(msg, 1.0)
    loads = {url: b.workers[url].decode_load for url in (D1, D2)}
    assert (loads[first].num_assigned, loads[other].num_assigned) == (0, 1)  # type: ignore[union-attr]
    assert loads[other].assigned_tokens == 100  # type: ignore[union-attr]
    assert ss.num_remote() == 0 and short.view.decode[0].num_assigned == 0  # it lacks d2
    assert sb.num_bad == ss.num_bad == 0
    sa.outbox.clear()
    a.finish(placed, 2.0)  # type: ignore[arg-type]
    for msg in sa.outbox:
        sb.apply(msg, 2.0)
    assert sb.num_remote() == 0 and loads[other].num_assigned == 0  # type: ignore[union-attr]


def test_the_socket_folder_is_the_users_alone(tmp_path: Path, vclock: VirtualClock) -> None:
    async def run() -> None:
        link = PeerLink.attach(live(vclock), tmp_path, 0, 2, vclock)
        link.start()
        try:
            path = peer_socket(tmp_path, 0)
            assert path.stat().st_mode & 0o777 == 0o600
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
                s.sendto(b"not msgpack", str(path))
            await settle(link)
            assert link.shared.num_bad == 1
        finally:
            await link.stop()

    asyncio.run(run())
