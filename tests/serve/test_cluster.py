"""LiveCluster: /info and /load JSON -> ClusterView + PrefixIndex the conductor schedules over."""

from __future__ import annotations

import pytest

from kvpool.clock import VirtualClock
from kvpool.conductor import Accepted, Conductor, ConductorConfig, RequestInfo
from kvpool.engine.worker.messages import InfoReply, LoadReply, parse
from kvpool.errors import InvalidArgument
from kvpool.serve.cluster import LiveCluster
from tests.conductor.conftest import SIMPLE_COST

P1, P2, D1 = "http://p1", "http://p2", "http://d1"


def info(role: str, model_hash: int = 7, block_size: int = 4) -> InfoReply:
    return parse(InfoReply, {"role": role, "model": "tiny", "model_hash": model_hash,
                                 "block_size": block_size, "max_model_len": 256,
                                 "kv_capacity_tokens": 1000, "segment": "127.0.0.1:1"}, "/info")


def load(blocks: list[int], queued: int = 0) -> LoadReply:
    return LoadReply(num_waiting=0, num_running=0, queued_prefill_tokens=queued,
                     running_tokens=0, free_kv_tokens=900, kv_capacity_tokens=1000,
                     block_hashes=blocks)


def two_prefill_one_decode(clock: VirtualClock) -> LiveCluster:
    """p1, p2 (prefill) and d1 (decode) joined."""
    c = LiveCluster(SIMPLE_COST, clock, dead_after_failures=2, silent_dead_s=5.0)
    for url, role in ((P2, "prefill"), (P1, "prefill"), (D1, "decode")):
        c.add(url)
        c.join(url, info(role))
    return c


@pytest.fixture
def cluster(vclock: VirtualClock) -> LiveCluster:
    return two_prefill_one_decode(vclock)


def test_load_reports_become_the_prefix_index(cluster: LiveCluster) -> None:
    cluster.apply_load(P1, load([1, 2, 3]), 0.0)
    cluster.apply_load(P2, load([1]), 0.0)
    cluster.check_integrity()
    assert [p.instance_id for p in cluster.view.prefill] == [0, 1]  # sorted by url: p1, p2
    assert cluster.view.index.match([1, 2, 3, 4]).lens == {0: 3, 1: 1}
    cluster.apply_load(P1, load([1, 2, 9]), 0.0)  # evicted 3, gained 9
    cluster.check_integrity()
    assert cluster.view.index.match([1, 2, 3]).lens == {0: 2, 1: 1}
    assert cluster.view.index.holders(9) == {0}


def test_prediction_errors_shift_the_queue_as_in_the_simulator(cluster: LiveCluster) -> None:
    conductor = Conductor(ConductorConfig(block_size=4), SIMPLE_COST)
    reqs = [RequestInfo(i, 100, 4, ()) for i in range(3)]
    bookings = []
    for r in reqs:  # 0.1 s predicted each, all on p1 (then p2) by load balance of kvcache_centric
        decision = conductor.schedule(r, cluster.view, 0.0)
        assert isinstance(decision, Accepted)
        bookings.append(cluster.book(r, decision, 0.0))
    p1 = bookings[0].prefill_load
    mine = [b for b in bookings if b.prefill_load is p1]
    assert len(mine) == 2 and p1.busy_until_s == pytest.approx(0.2)
    cluster.prefill_done(mine[0], 0.15)  # 50 ms late: the one behind it ends 50 ms later too
    assert p1.busy_until_s == pytest.approx(0.25)
    cluster.prefill_done(mine[1], 0.2)  # early now: the queue is empty at 0.2
    assert p1.busy_until_s == pytest.approx(0.2) and p1.queue_s(0.2) == 0.0


def test_dead_worker_leaves_and_ids_are_reassigned(cluster: LiveCluster,
                                                   vclock: VirtualClock) -> None:
    cluster.apply_load(P1, load([1]), 0.0)
    cluster.apply_load(P2, load([1, 2]), 0.0)
    down = cluster.workers[P1].down
    assert not cluster.poll_failed(P1, refused=True)
    assert cluster.poll_failed(P1, refused=True) and down.is_set()
    cluster.check_integrity()
    assert [w.url for w in cluster.alive(("prefill",))] == [P2]
    assert cluster.view.prefill[0].instance_id == 0
    assert cluster.view.index.match([1, 2]).lens == {0: 2}
    cluster.join(P1, info("prefill"))  # it answers again
    cluster.check_integrity()
    assert len(cluster.view.prefill) == 2 and not cluster.workers[P1].down.is_set()


def test_a_silent_worker_leaves_after_silent_dead_s(cluster: LiveCluster,
                                                    vclock: VirtualClock) -> None:
    assert not cluster.poll_failed(D1, refused=False)
    vclock.advance(5.0)
    assert cluster.poll_failed(D1, refused=False)
    assert cluster.view.decode == []


def test_another_model_or_block_size_is_refused(cluster: LiveCluster) -> None:
    cluster.add("http://x")
    with pytest.raises(InvalidArgument, match="model hash"):
        cluster.join("http://x", info("prefill", model_hash=8))
    with pytest.raises(InvalidArgument, match="block size"):
        cluster.join("http://x", info("prefill", block_size=8))


def test_booking_follows_the_conductor_and_releases_once(cluster: LiveCluster) -> None:
    cluster.apply_load(P2, load([1, 2]), 0.0)
    conductor = Conductor(ConductorConfig(block_size=4), SIMPLE_COST)
    req = RequestInfo(1, 12, 4, (1, 2, 3))
    decision = conductor.schedule(req, cluster.view, 0.0)
    assert isinstance(decision, Accepted)
    assert decision.prefill.instance_id == 1 and decision.prefill.prefix_len == 8  # p2 holds 2
    b = cluster.book(req, decision, 0.0)
    assert b.prefill.url == P2 and b.decode.url == D1 and not b.colocated
    assert cluster.in_flight == 1
    d = cluster.view.decode[0]
    assert (d.num_assigned, d.num_active, cluster.view.prefill[1].num_queued) == (1, 0, 1)
    cluster.prefill_done(b, 0.01)
    cluster.decode_start(b, 0.01)
    assert (d.num_assigned, d.num_active, cluster.view.prefill[1].num_queued) == (1, 1, 0)
    assert cluster.view.prefill[1].queue_s(0.01) == 0.0
    cluster.finish(b, 0.02)
    cluster.finish(b, 0.03)
    assert (d.num_assigned, d.num_active, d.planned) == (0, 0, {})
    assert cluster.in_flight == 0
    remote = cluster.book(req, decision, 0.1, remote=True)  # another process's: not in flight here
    assert cluster.in_flight == 0
    cluster.finish(remote, 0.2)
    assert cluster.in_flight == 0
    cluster.check_integrity()


def test_booking_on_a_worker_that_died_is_dropped_quietly(cluster: LiveCluster) -> None:
    conductor = Conductor(ConductorConfig(block_size=4), SIMPLE_COST)
    req = RequestInfo(1, 8, 4, (1, 2))
    decision = conductor.schedule(req, cluster.view, 0.0)
    assert isinstance(decision, Accepted)
    b = cluster.book(req, decision, 0.0)
    cluster.poll_failed(D1, refused=True)
    cluster.poll_failed(D1, refused=True)
    cluster.finish(b, 1.0)  # the decode load is no longer in the view: nothing to release
    cluster.check_integrity()


def test_both_role_worker_decodes_what_it_prefilled(vclock: VirtualClock) -> None:
    c = LiveCluster(SIMPLE_COST, vclock)
    for url in ("http://a", "http://b"):
        c.add(url)
        c.join(url, info("both"))
    c.apply_load("http://b", load([1, 2]), 0.0)
    conductor = Conductor(ConductorConfig(block_size=4), SIMPLE_COST)
    req = RequestInfo(1, 8, 4, (1, 2))
    decision = conductor.schedule(req, c.view, 0.0)
    assert isinstance(decision, Accepted)
    b = c.book(req, decision, 0.0)  # the conductor paired b's decode with its prefill
    assert b.colocated and b.prefill.url == "http://b"


def test_malformed_reports_are_invalid_arguments() -> None:
    with pytest.raises(InvalidArgument, match="malformed /info: model_hash: Field required"):
        parse(InfoReply, {"role": "prefill"}, "/info")
    with pytest.raises(InvalidArgument, match="malformed /info: role: Input should be"):
        parse(InfoReply, {"role": "chef", "model_hash": 1, "block_size": 4,
                          "max_model_len": 8, "kv_capacity_tokens": 8}, "/info")
    with pytest.raises(InvalidArgument, match="block_size: Input should be greater than 0"):
        parse(InfoReply, {"role": "decode", "model_hash": 1, "block_size": 0,
                          "max_model_len": 8, "kv_capacity_tokens": 8}, "/info")
    with pytest.raises(InvalidArgument, match="malformed /load: block_events.0"):
        parse(LoadReply, {"block_events": [[1]]}, "/load")


def test_bookings_released_before_their_prefill_ran_leave_no_phantom_queue() -> None:
    """27 of 28 queued requests go away before their prefill ran (clients gone, choices
    refused): their release is no prediction error to shift the queue by. Once the one
    that ran has answered, nothing is queued, the worker is idle in the view, and a fresh
    long request is accepted (it was refused for a queue of ~28 s that nobody was in)."""
    from kvpool.conductor import CostModel, Rejected

    clock = VirtualClock(0.0)
    cost = CostModel()
    live = LiveCluster(cost, clock)
    for url, role in (("http://p", "prefill"), ("http://d", "decode")):
        live.add(url)
        live.join(url, InfoReply(role=role, model_hash=1, block_size=16, max_model_len=100000,
                                 kv_capacity_tokens=10**6))
    conductor = Conductor(ConductorConfig(block_size=16, ttft_slo_s=30.0), cost, clock)

    def req(i: int, n: int = 8000) -> RequestInfo:
        return RequestInfo(i, n, 16, tuple(range(i * 10**6, i * 10**6 + n // 16)))
    books = []
    for i in range(1, 29):
        decision = conductor.schedule(req(i), live.view, clock.now())
        assert isinstance(decision, Accepted)
        books.append(live.book(req(i), decision, clock.now()))
    clock.advance(0.1)
    for b in books[1:]:
        live.finish(b, clock.now())
    clock.advance(1.0)                                   # the first one's prefill ends
    live.prefill_done(books[0], clock.now())
    live.finish(books[0], clock.now())
    load = live.view.prefill[0]
    assert load.num_queued == 0 and load.queue_s(clock.now()) == 0.0
    assert not isinstance(conductor.schedule(req(99, 12000), live.view, clock.now()), Rejected)


def test_a_migrated_decode_moves_its_load_to_the_worker_that_resumes_it() -> None:
    """The decode worker fails mid-stream and another resumes the request: the view counts
    it on the new worker (assigned, then running from its next frame), not on the old one,
    and releases it there."""
    from kvpool.conductor import CostModel

    clock = VirtualClock(0.0)
    live = LiveCluster(CostModel(), clock)
    for url, role in (("http://p", "prefill"), ("http://d1", "decode"),
                      ("http://d2", "decode")):
        live.add(url)
        live.join(url, InfoReply(role=role, model_hash=1, block_size=16, max_model_len=100000,
                                 kv_capacity_tokens=10**6))
    conductor = Conductor(ConductorConfig(block_size=16), CostModel(), clock)
    req = RequestInfo(1, 800, 16, tuple(range(50)))
    decision = conductor.schedule(req, live.view, 0.0)
    assert isinstance(decision, Accepted)
    b = live.book(req, decision, 0.0)
    live.prefill_done(b, 0.5)
    live.decode_start(b, 0.6)
    old = b.decode_load
    other = next(w for w in live.workers.values() if w.role == "decode" and w is not b.decode)
    live.move_decode(b, other, 1.0)
    assert (old.num_assigned, old.num_active, old.assigned_tokens) == (0, 0, 0)
    new = other.decode_load
    assert new is not None and b.decode_load is new
    assert (new.num_assigned, new.num_active, new.assigned_tokens) == (1, 0, 800)
    live.decode_start(b, 1.2)
    assert (new.num_active, new.active_tokens) == (1, 800)
    live.finish(b, 2.0)
    assert (new.num_assigned, new.num_active, new.assigned_tokens) == (0, 0, 0)
    assert (old.num_assigned, old.num_active) == (0, 0)


@pytest.mark.parametrize(("raw", "problem"), [
    (b"", "body: Invalid JSON"), (b"<html>", "body: Invalid JSON"),
    (b"[]", "body: Input should be an object"),
    (b'{"block_events": [[1, "x"]]}', "block_events.0.1: Input should be a valid boolean")])
def test_a_reply_that_is_not_the_message_names_the_worker_the_call_and_the_problem(
        raw: bytes, problem: str) -> None:
    from kvpool.engine.worker.messages import LoadReply, reply_from
    from kvpool.errors import WorkerCallError

    with pytest.raises(WorkerCallError) as err:
        reply_from("http://127.0.0.1:9", "/load", LoadReply, raw)
    text = str(err.value)
    assert "http://127.0.0.1:9" in text and f"malformed /load reply: {problem}" in text
    assert repr(raw[:200]) in text


def test_a_load_reply_keeps_64_bit_hashes_and_event_order() -> None:
    from kvpool.engine.worker.messages import LoadReply, reply_from

    top = 2**64 - 1
    load = reply_from("http://w", "/load", LoadReply,
                      b'{"block_events": [[%d, true], [5, false], [%d, false]]}' % (top, top))
    assert load.block_events == [(top, True), (5, False), (top, False)]


def test_a_block_stored_again_stays_held(vclock: VirtualClock) -> None:
    """An event stream that says "stored" of a block held already (a replay overlapping
    what was read) keeps it: only "removed" takes a block out."""
    c = two_prefill_one_decode(vclock)
    events = LoadReply(num_waiting=0, num_running=0, queued_prefill_tokens=0, running_tokens=0,
                       free_kv_tokens=900, kv_capacity_tokens=1000,
                       block_events=[(5, True), (5, True), (6, True), (6, False)])
    c.apply_load(P1, events, 0.0)
    assert c.workers[P1].blocks == {5}
    assert c.view.index.holders(5) == {c.workers[P1].prefill_load.instance_id}  # type: ignore[union-attr]
    c.check_integrity()
