"""The master side of a damaged replica (store/master/damage.py), on a virtual clock with the
integrity check after every step: the reported replica leaves, the object with it when it
was the last; a report of another version, or of an unknown replica, changes nothing; the
range is freed when the read lease ends; the drop is journaled."""

from __future__ import annotations

from pathlib import Path

from kvpool.clock import VirtualClock
from kvpool.store.config import MasterConfig, ReplicateConfig
from kvpool.store.master.core import MasterCore
from kvpool.store.master.damage import drop_damaged
from kvpool.store.master.persist import Journal, PersistConfig, load_state
from kvpool.store.wire.codes import ErrorCode as E
from kvpool.store.wire.codes import ReplicaDesc
from tests.store.conftest import KIB, make_core

A = "127.0.0.1:9000"
B = "127.0.0.1:9001"


def put(core: MasterCore, key: str, checksum: int, replicas: int = 1) -> list[ReplicaDesc]:
    cfg = ReplicateConfig(replica_num=replicas, preferred_segments=(A, B)[:replicas])
    (res,) = core.put_start("w", [key], [KIB], cfg, False)
    assert res.code == E.OK, res
    assert core.put_end("w", [key], [checksum]) == [E.OK]
    core.check_integrity()
    (look,) = core.get_replicas([key])  # a reader's lookup: a read lease
    return sorted(look.replicas, key=lambda r: r.endpoint)


def report(core: MasterCore, key: str, replica: ReplicaDesc, checksum: int) -> E:
    (code,) = drop_damaged(core, [key], [replica.segment_id], [replica.addr], [checksum])
    core.check_integrity()
    return code


def test_the_last_replica_takes_the_object_with_it(vclock: VirtualClock) -> None:
    core = make_core(vclock)
    (rep,) = put(core, "k", 0xAB)
    used = core.used_bytes
    assert report(core, "k", rep, 0xAB) == E.OK
    assert "k" not in core.objects and core.stats.damaged_dropped == 1
    assert core.used_bytes == used          # a reader may still copy from it: its lease
    vclock.advance(core.config.lease_ttl_s + 0.1)
    core.release_deferred()
    assert core.used_bytes == used - KIB
    assert report(core, "k", rep, 0xAB) == E.OBJECT_NOT_FOUND
    assert core.stats.damaged_dropped == 1


def test_a_damaged_replica_leaves_and_the_good_one_stays(vclock: VirtualClock) -> None:
    core = make_core(vclock)
    a, b = put(core, "k", 7, replicas=2)
    assert report(core, "k", a, 7) == E.OK
    (left,) = core.get_replicas(["k"])[0].replicas
    assert left == b and core.stats.damaged_dropped == 1


def test_a_report_of_another_version_or_replica_changes_nothing(vclock: VirtualClock) -> None:
    core = make_core(vclock)
    (old,) = put(core, "k", 1)
    assert report(core, "k", old, 2) == E.OBJECT_NOT_FOUND       # the reader saw other bytes
    assert report(core, "k", old._replace(addr=old.addr + 8), 1) == E.OBJECT_NOT_FOUND
    assert report(core, "k", old._replace(segment_id="nope"), 1) == E.OBJECT_NOT_FOUND
    assert report(core, "gone", old, 1) == E.OBJECT_NOT_FOUND
    assert core.stats.damaged_dropped == 0 and "k" in core.objects
    assert drop_damaged(core, ["k"], [], [old.addr], [1]) == [E.INVALID_PARAMS]
    assert drop_damaged(core, ["k"], [old.segment_id], ["x"], [1]) == [  # type: ignore[list-item]
        E.INVALID_PARAMS]


def test_a_drop_is_journaled(vclock: VirtualClock, tmp_path: Path) -> None:
    core = MasterCore(MasterConfig(seed=7), vclock)
    core.journal = Journal(PersistConfig(str(tmp_path)), core)
    for i in range(2):
        assert core.mount_segment(f"c{i}", f"127.0.0.1:{9000 + i}", 0x10000, 64 * KIB,
                                  fence=i + 1)[0] == E.OK
    a, b = put(core, "two", 5, replicas=2)
    (one,) = put(core, "one", 6)
    assert report(core, "two", a, 5) == E.OK and report(core, "one", one, 6) == E.OK
    core.journal.commit()
    core.journal.close()
    state, _ = load_state(tmp_path)
    assert list(state.objects) == ["two"]
    assert [s for s, _ in state.objects["two"].replicas] == [b.segment_id]
