"""The master's journal kept in etcd (HA without a shared directory): replay, compaction,
chunked snapshots and the term fence, against a real etcd."""

from __future__ import annotations

import base64
import itertools
import random
from collections.abc import Iterator
from typing import Any

import pytest

from kvpool.clock import VirtualClock
from kvpool.errors import KvpoolError, StoreError
from kvpool.store.config import MasterConfig, ReplicateConfig
from kvpool.store.master.core import MasterCore
from kvpool.store.master.election import LeaderElection
from kvpool.store.master.log_etcd import EtcdLogStore, chunked
from kvpool.store.master.persist import Journal, PersistConfig
from kvpool.store.master.records import encode_record
from kvpool.store.wire.codes import ErrorCode as E
from kvpool.store.wire.leader import Etcd, parse_endpoints
from tests.support.etcd import etcd_server
from tests.support.net import free_port

KIB = 1024
_clusters = itertools.count()


@pytest.fixture(scope="module")
def etcd() -> Iterator[str]:
    with etcd_server() as endpoint:
        yield endpoint


def elect(etcd: str, cluster: str) -> LeaderElection:
    election = LeaderElection(Etcd(parse_endpoints(etcd)), "127.0.0.1:1", 30, cluster)
    assert election.try_acquire()
    return election


def open_core(clock: VirtualClock, etcd: str, cluster: str, term: int,
              compact_bytes: int = 64 << 20, seed: int = 7) -> MasterCore:
    core = MasterCore(MasterConfig(seed=seed), clock)
    config = PersistConfig("", etcd=etcd, cluster_id=cluster, compact_bytes=compact_bytes)
    core.journal = Journal(config, core, term)
    return core


def mount(core: MasterCore, i: int, fence: int) -> str:
    code, sid = core.mount_segment(f"c{i}", f"127.0.0.1:{9000 + i}", 0x10000, 1 << 30,
                                   fence=fence)
    assert code == E.OK
    return sid


def tables(core: MasterCore) -> dict[str, tuple[int, int | None, list[tuple[str, int]]]]:
    return {k: (o.size, o.checksum, sorted((r.segment.segment_id, r.offset)
                                           for r in o.replicas))
            for k, o in core.objects.items()}


def test_chunks_hold_whole_records() -> None:
    records = [encode_record(["R", "k" * n]) for n in range(1, 300)]
    values = list(chunked(records, limit=1000))
    assert b"".join(values) == b"".join(records)
    assert all(len(v) <= 1000 for v in values)
    assert list(chunked([b"x" * 5000], limit=1000)) == [b"x" * 5000]


def test_random_histories_replay_from_etcd(etcd: str) -> None:
    """Random puts, upserts, removes and evictions with compactions on the way: a new
    leader replaying etcd has exactly the objects of the old one, at the same addresses."""
    for seed in range(3):
        rng, clock = random.Random(seed), VirtualClock()
        cluster = f"hist{next(_clusters)}"
        core = open_core(clock, etcd, cluster, elect(etcd, cluster).term, 4096, seed)
        for i in range(2):
            mount(core, i, 100 + i)
        for _ in range(150):
            key = f"k{rng.randrange(40)}"
            if rng.random() < 0.6:
                (res,) = core.put_start("w", [key], [rng.choice([200, 5000])],
                                        ReplicateConfig(replica_num=rng.choice([1, 2])),
                                        upsert=rng.random() < 0.3)
                if res.code == E.OK:
                    core.put_end("w", [key], [rng.randrange(1 << 64)])
            else:
                core.remove([key], force=True)
            core.heartbeat("w"), core.heartbeat("c0"), core.heartbeat("c1")
            core.tick()
        assert core.journal is not None and core.journal.commit()
        want = tables(core)
        successor = LeaderElection(Etcd(parse_endpoints(etcd)), "127.0.0.1:2", 30, cluster)
        successor.etcd.post("/kv/deleterange", {"key": _b64(successor.key)})
        assert successor.try_acquire()
        core2 = open_core(clock, etcd, cluster, successor.term, seed=seed)
        for i in range(2):
            mount(core2, i, 200 + i)
        assert tables(core2) == want, seed
        core2.check_integrity()


def test_a_snapshot_larger_than_an_etcd_value_is_chunked(etcd: str) -> None:
    clock, cluster = VirtualClock(), f"big{next(_clusters)}"
    term = elect(etcd, cluster).term
    core = open_core(clock, etcd, cluster, term)
    mount(core, 0, 5)
    keys = [f"object-{i:06d}-" + "x" * 100 for i in range(12000)]
    for start in range(0, len(keys), 4000):
        batch = keys[start:start + 4000]
        core.put_start("w", batch, [64] * len(batch), ReplicateConfig())
        core.put_end("w", batch, list(range(len(batch))))
    assert core.journal is not None
    core.journal.compact(core)  # the snapshot is ~1.8 MB: two etcd values at least
    core2 = open_core(clock, etcd, cluster, term)
    mount(core2, 0, 6)
    assert sorted(core2.objects) == sorted(keys)


def test_a_later_term_fences_the_old_journal(etcd: str) -> None:
    clock, cluster = VirtualClock(), f"fence{next(_clusters)}"
    old = elect(etcd, cluster)
    core = open_core(clock, etcd, cluster, old.term)
    mount(core, 0, 5)
    (res,) = core.put_start("w", ["a"], [KIB], ReplicateConfig())
    core.put_end("w", ["a"], [1])
    assert core.journal is not None and core.journal.commit()
    new = LeaderElection(Etcd(parse_endpoints(etcd)), "127.0.0.1:2", 30, cluster)
    new.etcd.post("/kv/deleterange", {"key": _b64(new.key)})  # the old lease "expired"
    assert new.try_acquire() and new.term == old.term + 1
    core.put_start("w", ["b"], [KIB], ReplicateConfig())
    core.put_end("w", ["b"], [2])
    assert not core.journal.commit()  # the deposed leader acknowledges nothing more
    with pytest.raises(StoreError, match="later term"):
        core.journal.compact(core)
    core2 = open_core(clock, etcd, cluster, new.term)
    mount(core2, 0, 6)
    assert sorted(core2.objects) == ["a"]


def test_an_append_etcd_does_not_answer_takes_the_put_back(etcd: str) -> None:
    """etcd unreachable: the put fails and is not visible; the values of the failed append
    (here one that etcd did apply, unbeknown to the master) are deleted by the next one."""
    clock, cluster = VirtualClock(), f"down{next(_clusters)}"
    term = elect(etcd, cluster).term
    core = open_core(clock, etcd, cluster, term)
    sid = mount(core, 0, 5)
    assert isinstance(core.journal, Journal)
    store = core.journal.store
    assert isinstance(store, EtcdLogStore)
    reachable, store.etcd = store.etcd, Etcd(parse_endpoints(f"127.0.0.1:{free_port()}"))
    core.put_start("w", ["lost"], [KIB], ReplicateConfig())
    assert core.put_end("w", ["lost"], [1]) == [E.OK]
    assert not core.journal.commit()
    assert core.get_replicas(["lost"])[0].code == E.OBJECT_NOT_FOUND
    assert "etcd unreachable" in (core.journal.write_error or "")
    core.check_integrity()
    store.etcd = reachable
    landed_key = store._key("log", store._gen, store._seq)
    record = encode_record(["P", "lost", KIB, [[sid, 0]], 1, False])
    reachable.post("/kv/put", {"key": _b64(landed_key),
                               "value": base64.b64encode(record).decode()})
    core.put_start("w", ["kept"], [KIB], ReplicateConfig())
    core.put_end("w", ["kept"], [2])
    assert core.journal.commit() and core.journal.write_error is None
    assert reachable.get(landed_key) is None
    core2 = open_core(clock, etcd, cluster, term)
    mount(core2, 0, 6)
    assert sorted(core2.objects) == ["kept"]


def test_memory_of_an_append_etcd_may_have_applied_is_not_reused_until_voided(
        etcd: str) -> None:
    """etcd applies an append whose answer the master never gets: the put is refused and
    taken back, but its memory stays allocated until a later append has voided its record.
    Otherwise the next put gets that memory, and a leader that takes over before that append
    replays the refused put onto the other put's bytes."""
    clock, cluster = VirtualClock(), f"unsure{next(_clusters)}"
    term = elect(etcd, cluster).term
    core = open_core(clock, etcd, cluster, term)
    mount(core, 0, 5)
    assert isinstance(core.journal, Journal)
    store = core.journal.store
    assert isinstance(store, EtcdLogStore)
    post, answered = store.etcd.post, [False]

    def applied_unanswered(path: str, body: Any) -> Any:
        out = post(path, body)
        if path == "/kv/txn" and not answered[0]:
            answered[0] = True
            raise KvpoolError("etcd unreachable for /kv/txn: timed out")
        return out
    store.etcd.post = applied_unanswered  # type: ignore[method-assign]
    (lost,) = core.put_start("w", ["lost"], [KIB], ReplicateConfig())
    assert core.put_end("w", ["lost"], [None]) == [E.OK]
    assert not core.journal.commit()
    assert core.get_replicas(["lost"])[0].code == E.OBJECT_NOT_FOUND
    (pending,) = core.put_start("w", ["next"], [KIB], ReplicateConfig())
    assert pending.replicas[0].addr != lost.replicas[0].addr
    core.check_integrity()
    assert core.put_end("w", ["next"], [2]) == [E.OK]  # the next append voids "lost"
    assert core.journal.commit()
    (reused,) = core.put_start("w", ["again"], [KIB], ReplicateConfig())
    assert reused.replicas[0].addr == lost.replicas[0].addr   # released
    core.check_integrity()
    after = open_core(clock, etcd, cluster, term)
    mount(after, 0, 7)
    assert sorted(after.objects) == ["next"]


def _b64(text: str) -> str:
    from kvpool.store.wire.leader import b64
    return b64(text)
