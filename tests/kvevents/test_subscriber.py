"""Subscriber and publisher over real ZMQ sockets on 127.0.0.1: joins, gaps, replay, resync."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import zmq

from kvpool.kvevents.codec import decode_batch, encode_batch
from kvpool.kvevents.events import BlockStored, EventBatch
from kvpool.kvevents.index import CacheIndex
from kvpool.kvevents.publisher import KvEventPublisher
from kvpool.kvevents.subscriber import KvEventSubscriber, fetch_replay
from tests.support.net import free_port
from tests.support.wait import wait_for

LOCAL = "tcp://127.0.0.1:0"


def stored(*hashes: int) -> EventBatch:
    return EventBatch(ts=1.0, events=[BlockStored(block_hashes=list(hashes), token_ids=[],
                                                  block_size=16, medium="GPU")])


class LossyPublisher(KvEventPublisher):
    """Keeps every batch for replay but does not send the seqs in `lose` (a lost message)."""

    lose: set[int] = set()

    def _send(self, batch: EventBatch) -> None:
        seq = self._next_seq
        if seq in self.lose:
            self._buffer.append((seq, encode_batch(batch)))
            self._next_seq = seq + 1
        else:
            super()._send(batch)


@pytest.fixture
def index() -> CacheIndex:
    return CacheIndex()


@pytest.fixture
def sub(index: CacheIndex) -> Iterator[KvEventSubscriber]:
    s = KvEventSubscriber(LOCAL, index, replay_timeout_s=0.5).start()
    yield s
    s.close()


def connect(sub: KvEventSubscriber, topic: str, cls: type = KvEventPublisher, replay: bool = True,
            **kw: object) -> KvEventPublisher:
    pub = cls(sub.endpoint, LOCAL if replay else None, topic, **kw)
    if replay:
        sub.set_replay_endpoint(topic, pub.replay_endpoint)
    return pub


def joined(sub: KvEventSubscriber, pub: KvEventPublisher, name: str, first: int) -> None:
    """Publish `first` until `sub` has seen `name`, then wait for everything sent so far
    (messages lost while the subscription was forming come back through the join's replay)."""
    until(lambda: pub.publish(stored(first)), lambda: sub.stats(name).num_batches > 0)
    assert pub.flush()
    wait_for(lambda: sub.stats(name).last_seq == pub.next_seq - 1)


def test_two_instances_on_one_endpoint_by_topic(sub: KvEventSubscriber, index: CacheIndex) -> None:
    a, b = connect(sub, "a"), connect(sub, "b")
    joined(sub, a, "a", 10)
    joined(sub, b, "b", 20)
    for i in (1, 2):
        a.publish(stored(10 + i))
        b.publish(stored(20 + i))
    assert a.flush() and b.flush()
    wait_for(lambda: sub.stats("a").last_seq == a.next_seq - 1
             and sub.stats("b").last_seq == b.next_seq - 1)
    assert index.matched_blocks("a", [10, 11, 12]) == 3 and index.matched_blocks("b", [20, 21, 22]) == 3
    assert index.matched_blocks("a", [20]) == 0
    for name, pub in (("a", a), ("b", b)):
        stats = sub.stats(name)
        assert stats.num_resyncs == 1 and not stats.partial and stats.num_batches == pub.next_seq
    a.close(), b.close()


def test_a_gap_is_replayed(sub: KvEventSubscriber, index: CacheIndex) -> None:
    pub = connect(sub, "g", LossyPublisher)
    joined(sub, pub, "g", 0)
    before, base = sub.stats("g"), pub.next_seq
    pub.lose = {base + 1, base + 2}  # type: ignore[attr-defined]
    for h in (1, 2, 3, 4):
        pub.publish(stored(h))
    wait_for(lambda: sub.stats("g").last_seq == base + 3)
    after = sub.stats("g")
    assert after.num_gaps - before.num_gaps == 1 and after.num_replayed - before.num_replayed == 2
    assert after.num_resyncs == before.num_resyncs and not after.partial
    assert index.matched_blocks("g", [0, 1, 2, 3, 4]) == 5
    pub.close()


def test_a_gap_past_the_replay_buffer_resyncs(sub: KvEventSubscriber, index: CacheIndex) -> None:
    pub = connect(sub, "r", LossyPublisher, buffer_steps=2)
    joined(sub, pub, "r", 0)
    before, base = sub.stats("r"), pub.next_seq
    pub.lose = {base + 1, base + 2, base + 3}  # type: ignore[attr-defined]
    for h in (1, 2, 3, 4, 5):
        pub.publish(stored(h))
    wait_for(lambda: sub.stats("r").last_seq == base + 4)
    after = sub.stats("r")
    assert after.num_gaps - before.num_gaps == 1 and after.num_resyncs - before.num_resyncs == 1
    assert after.partial
    # cleared; then the replayable tail (block 4: the buffer keeps 2 batches) and block 5
    assert index.matched_blocks("r", [4, 5]) == 2
    assert index.matched_blocks("r", [0]) == 0 and index.matched_blocks("r", [1]) == 0
    pub.close()


def until(act: Callable[[], object], check: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Repeat `act` until `check` holds (a connecting PUB drops messages until subscribed)."""
    deadline = time.monotonic() + timeout_s
    while True:
        act()
        time.sleep(0.02)
        if check():
            return
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met")


def test_a_late_join_without_replay_is_partial_and_a_restart_resyncs(index: CacheIndex) -> None:
    port = free_port()
    pub = KvEventPublisher(f"tcp://127.0.0.1:{port}", topic="late")
    for h in range(3):
        pub.publish(stored(h))  # nobody subscribed: lost
    wait_for(lambda: pub.next_seq == 3)
    sub = KvEventSubscriber(f"tcp://127.0.0.1:{port}", index).start()
    try:
        until(lambda: pub.publish(stored(50)), lambda: sub.stats("late").num_batches > 0)
        stats = sub.stats("late")
        assert stats.partial and stats.num_resyncs == 1 and stats.last_seq >= 3
        assert index.matched_blocks("late", [50]) == 1 and index.matched_blocks("late", [0]) == 0
        pub.close()
        again = KvEventPublisher(f"tcp://127.0.0.1:{port}", topic="late")
        # the resync is counted before the batch that caused it is applied: wait for both
        until(lambda: again.publish(stored(60)),
              lambda: sub.stats("late").num_resyncs == 2 and index.matched_blocks("late", [60]) == 1)
        assert index.matched_blocks("late", [50]) == 0 and sub.stats("late").num_resyncs == 2
        again.close()
    finally:
        sub.close()


def test_replay_protocol_bytes(index: CacheIndex) -> None:
    pub = KvEventPublisher("tcp://127.0.0.1:0", LOCAL, "t", bind=True)
    for h in range(4):
        pub.publish(stored(h))
    wait_for(lambda: pub.next_seq == 4)
    ctx = zmq.Context.instance()
    assert pub.replay_endpoint is not None
    got = fetch_replay(ctx, pub.replay_endpoint, 2, 1000)
    assert [seq for seq, _ in got] == [2, 3]
    assert decode_batch(got[0][1]).events == stored(2).events
    req = ctx.socket(zmq.DEALER)
    req.connect(pub.replay_endpoint)
    req.send_multipart([b"", (0).to_bytes(8, "big")])
    frames = [req.recv_multipart() for _ in range(5)]
    assert [f[1:3] for f in frames[:4]] == [[b"t", i.to_bytes(8, "big")] for i in range(4)]
    assert frames[4] == [b"", b"", b"\xff" * 8, b""]
    req.close(0)
    pub.close()


def test_a_replay_without_topics_is_read_as_earlier_vllm_releases_send_it() -> None:
    """Before vLLM named the topic in its replies, a replay ROUTER answered each kept batch
    as (client, b"", seq, payload) and ended with (client, b"", END_SEQ, b"")."""
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")

    def answer() -> None:
        client, _, start = router.recv_multipart()
        for seq in range(int.from_bytes(start, "big"), 4):
            router.send_multipart((client, b"", seq.to_bytes(8, "big"), encode_batch(stored(seq))))
        router.send_multipart((client, b"", b"\xff" * 8, b""))

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    try:
        got = fetch_replay(ctx, f"tcp://127.0.0.1:{port}", 1, 2000)
    finally:
        thread.join(5)
        router.close()
    assert [seq for seq, _ in got] == [1, 2, 3]
    assert decode_batch(got[2][1]).events == stored(3).events


def test_a_forgotten_instance_is_cleared_and_its_next_batch_is_a_join(
        sub: KvEventSubscriber, index: CacheIndex) -> None:
    """An instance that left the rotation and came back may be a new process: its blocks go at
    once, and its next batch replays its history (here the same process: all of it back)."""
    pub = connect(sub, "f")
    joined(sub, pub, "f", 0)
    pub.publish(stored(1))
    assert pub.flush()
    wait_for(lambda: index.matched_blocks("f", [0, 1]) == 2)
    before = sub.stats("f")
    sub.forget("f")
    assert index.matched_blocks("f", [0]) == 0
    pub.publish(stored(2))
    assert pub.flush()
    wait_for(lambda: index.matched_blocks("f", [0, 1, 2]) == 3)
    after = sub.stats("f")
    assert after.num_resyncs == before.num_resyncs + 1 and not after.partial
    pub.close()


def test_a_malformed_payload_resyncs_the_instance(sub: KvEventSubscriber, index: CacheIndex) -> None:
    ctx = zmq.Context.instance()
    raw = ctx.socket(zmq.PUB)
    raw.connect(sub.endpoint)
    try:
        seqs = iter(range(1000))

        def send(payload: bytes) -> None:
            raw.send_multipart([b"m", next(seqs).to_bytes(8, "big"), payload])

        until(lambda: send(encode_batch(stored(7))), lambda: sub.stats("m").num_batches > 0)
        first = sub.stats("m")
        send(b"\xc1not msgpack")
        send(encode_batch(stored(8)))
        wait_for(lambda: sub.stats("m").num_batches == first.num_batches + 1)
        stats = sub.stats("m")
        assert stats.num_malformed == 1 and stats.partial and stats.num_resyncs == 2
        assert index.matched_blocks("m", [8]) == 1 and index.matched_blocks("m", [7]) == 0
    finally:
        raw.close(0)


def test_a_new_subscriber_of_a_quiet_publisher_learns_its_history(index: CacheIndex) -> None:
    """The publisher answers a subscription with an empty batch: the join replays from 0."""
    port = free_port()
    pub = KvEventPublisher(f"tcp://127.0.0.1:{port}", LOCAL, "quiet")
    for h in (1, 2, 3):
        pub.publish(stored(h))  # nobody listens yet
    assert pub.flush() and pub.next_seq == 3
    sub = KvEventSubscriber(f"tcp://127.0.0.1:{port}", index, replay_endpoints={"quiet": pub.replay_endpoint or ""})
    sub.start()
    try:
        wait_for(lambda: index.matched_blocks("quiet", [1, 2, 3]) == 3)
        stats = sub.stats("quiet")
        assert stats.num_replayed == 3 and not stats.partial and stats.last_seq == 3
    finally:
        pub.close()
        sub.close()


def test_connecting_to_publishers_that_bind(index: CacheIndex) -> None:
    """vLLM given `tcp://*:PORT` binds; the subscriber then connects, to each engine."""
    one = KvEventPublisher("tcp://127.0.0.1:0", topic="one", bind=True)
    two = KvEventPublisher("tcp://127.0.0.1:0", topic="two", bind=True)
    sub = KvEventSubscriber(one.endpoint, index, bind=False).start()
    sub.connect(two.endpoint)
    try:
        until(lambda: (one.publish(stored(1)), two.publish(stored(2))),
              lambda: index.matched_blocks("one", [1]) == 1 and index.matched_blocks("two", [2]) == 1)
    finally:
        one.close(), two.close()
        sub.close()


def test_a_publisher_restarted_past_its_old_counter_is_resynced(index: CacheIndex) -> None:
    """vLLM's publisher binds and the subscriber connects: a new process on the same port
    sends its first batches before the subscriber's socket reconnects, so they are lost, and
    the first seq seen can be at or past the old process's. The replay shows another batch
    at the seq applied last: the instance is rebuilt from the new process's history, and the
    dead process's blocks leave the index."""
    port, replay_port, topic = free_port(), free_port(), "http://inst-a:8000"
    endpoint, replay = f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay_port}"
    old = KvEventPublisher(endpoint, replay, topic=topic, bind=True)
    sub = KvEventSubscriber(endpoint, index, bind=False,
                            replay_endpoints={topic: replay}).start()
    try:
        until(lambda: old.publish(stored(111)),
              lambda: index.matched_blocks(topic, [111]) == 1)
        old.close()
        time.sleep(0.3)                                  # the process is gone
        new = KvEventPublisher(endpoint, replay, topic=topic, bind=True)
        try:
            for h in (222, 333, 444):
                new.publish(stored(h))
            new.flush()
            until(lambda: new.publish(stored(555)),
                  lambda: index.matched_blocks(topic, [555]) == 1)
            assert index.matched_blocks(topic, [111]) == 0
            assert index.matched_blocks(topic, [222]) == 1
        finally:
            new.close()
    finally:
        sub.close()


def _port_pair() -> int:
    """A port P with P + 1 free as well (a server's rank 0 and rank 1)."""
    import socket

    for _ in range(50):
        port = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise AssertionError("no two free ports in a row")


def test_a_servers_data_parallel_ranks_are_instances_of_their_own(index: CacheIndex) -> None:
    """vLLM's rank r publishes at the endpoint's port plus r, under the server's topic and
    with a sequence of its own: each rank's events land on an instance of its own (`#dp1`),
    each rank is ordered and replayed apart, and one rank's blocks are not the other's."""
    port = _port_pair()
    sub = KvEventSubscriber(f"tcp://127.0.0.1:{port}", index, replay_timeout_s=0.5,
                            ranks=1).start()
    server = "http://h:8000"
    rank0 = KvEventPublisher(f"tcp://127.0.0.1:{port}", LOCAL, server)
    rank1 = KvEventPublisher(f"tcp://127.0.0.1:{port + 1}", LOCAL, server, data_parallel_rank=1)
    sub.set_replay_endpoint(server, rank0.replay_endpoint)
    sub.set_replay_endpoint(f"{server}#dp1", rank1.replay_endpoint)
    try:
        joined(sub, rank0, server, 10)
        joined(sub, rank1, f"{server}#dp1", 20)
        for i in (1, 2):
            rank0.publish(stored(10 + i))
            rank1.publish(stored(20 + i))
        assert rank0.flush() and rank1.flush()
        wait_for(lambda: sub.stats(server).last_seq == rank0.next_seq - 1
                 and sub.stats(f"{server}#dp1").last_seq == rank1.next_seq - 1)
        assert index.matched_blocks(server, [10, 11, 12]) == 3
        assert index.matched_blocks(f"{server}#dp1", [20, 21, 22]) == 3
        assert index.matched_blocks(server, [20]) == index.matched_blocks(f"{server}#dp1", [10]) == 0
        for name in (server, f"{server}#dp1"):  # two sequences from 0, neither a restart
            assert sub.stats(name).num_resyncs == 1 and not sub.stats(name).partial
        assert sorted(sub.instances()) == [server, f"{server}#dp1"]
    finally:
        rank0.close(), rank1.close()
        sub.close()


def test_connecting_to_a_binding_server_reads_its_ranks_too(index: CacheIndex) -> None:
    """vLLM given `tcp://*:PORT` binds, each rank at the port plus its rank: a subscriber of
    ranks that connects to the server's endpoint reads every rank."""
    port = _port_pair()
    rank0 = KvEventPublisher(f"tcp://127.0.0.1:{port}", topic="s", bind=True)
    rank1 = KvEventPublisher(f"tcp://127.0.0.1:{port + 1}", topic="s", bind=True,
                             data_parallel_rank=1)
    own = _port_pair()  # (the server's two are bound by now)
    sub = KvEventSubscriber(f"tcp://127.0.0.1:{own}", index, ranks=1).start()
    sub.connect(f"tcp://127.0.0.1:{port}")
    try:
        until(lambda: (rank0.publish(stored(1)), rank1.publish(stored(2))),
              lambda: index.matched_blocks("s", [1]) == 1
              and index.matched_blocks("s#dp1", [2]) == 1)
        assert index.matched_blocks("s", [2]) == 0
    finally:
        rank0.close(), rank1.close()
        sub.close()


def test_ranks_need_an_endpoint_whose_port_can_be_offset(index: CacheIndex,
                                                         tmp_path: Path) -> None:
    from kvpool.errors import ConfigError
    from kvpool.kvevents.subscriber import offset_port

    assert offset_port("tcp://127.0.0.1:5557", 2) == "tcp://127.0.0.1:5559"
    assert offset_port("inproc://cache", 1) == "inproc://cache_dp1"
    assert offset_port("tcp://*:5557", 0) == "tcp://*:5557"
    for bad in ("tcp://127.0.0.1:0", "ipc:///tmp/x", "tcp://127.0.0.1"):
        with pytest.raises(ConfigError, match="data-parallel ranks"):
            offset_port(bad, 1)
    with pytest.raises(ConfigError, match="data-parallel ranks"):
        KvEventSubscriber(f"ipc://{tmp_path}/events.sock", index, ranks=1)
