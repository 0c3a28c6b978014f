"""The master core tells its pool-event sink of every medium a key gains or loses (sans-I/O)."""

from __future__ import annotations

from kvpool.clock import VirtualClock
from kvpool.kvevents.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvpool.kvevents.pool import PoolEventTranslator
from kvpool.store.config import ReplicateConfig
from kvpool.store.master.core import MasterCore
from kvpool.store.wire.codes import ErrorCode as E
from tests.store.conftest import KIB, make_core
from tests.store.master.test_master_core import put


def block_key(n: int, tp: int = 0) -> str:
    return f"m@tp_rank:{tp}@pcp0@dcp0@pp_rank:0@group:0@{n:064x}"


class Recorder:
    """A PoolEventSink that keeps the calls (the core's side of the seam, exactly)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, ...]] = []

    def stored(self, key: str, medium: str) -> None:
        self.calls.append(("stored", key, medium))

    def removed(self, key: str, medium: str) -> None:
        self.calls.append(("removed", key, medium))

    def cleared(self) -> None:
        self.calls.append(("cleared",))


def core_with(sink: object, vclock: VirtualClock, **kw: object) -> MasterCore:
    core = make_core(vclock, **kw)  # type: ignore[arg-type]
    core.objects.events = sink  # type: ignore[assignment]
    return core


def test_put_remove_upsert_and_wipe(vclock: VirtualClock) -> None:
    rec = Recorder()
    core = core_with(rec, vclock)
    core.put_start("w", ["p"], [KIB])
    assert rec.calls == []  # a pending put is not in the pool yet
    core.put_end("w", ["p"])
    assert put(core, "q", cfg=ReplicateConfig(replica_num=2)) == E.OK
    assert rec.calls == [("stored", "p", "cpu"), ("stored", "q", "cpu")]
    assert core.remove(["p"]) == [E.OK]
    assert put(core, "q", upsert=True) == E.OK
    assert rec.calls[2:] == [("removed", "p", "cpu"), ("removed", "q", "cpu"), ("stored", "q", "cpu")]
    assert core.remove_all() == 1
    assert rec.calls[5:] == [("removed", "q", "cpu"), ("cleared",)]
    assert core.remove_all() == 0 and len(rec.calls) == 7  # nothing left: no second clear


def test_eviction_and_a_dead_client(vclock: VirtualClock) -> None:
    rec = Recorder()
    core = core_with(rec, vclock, num_segments=1, capacity=4 * KIB, eviction_ratio=0.25)
    for i in range(4):
        assert put(core, f"k{i}") == E.OK
        vclock.advance(1)
    vclock.advance(11)
    assert put(core, "new") == E.OK
    assert rec.calls[4:] == [("removed", "k0", "cpu"), ("stored", "new", "cpu")]
    del rec.calls[:]
    for _ in range(12):  # c0, the only segment's owner, stops heartbeating and expires
        vclock.advance(1.0)
        core.tick()
    assert "c0" not in core.clients and len(core.objects) == 0
    # watermark eviction takes some first, the segment's loss the rest: each once
    assert sorted(rec.calls) == [("removed", k, "cpu") for k in ("k1", "k2", "k3", "new")]


def test_a_second_replica_on_the_same_medium_is_no_news(vclock: VirtualClock) -> None:
    rec = Recorder()
    core = core_with(rec, vclock, num_segments=3)
    cfg = ReplicateConfig(replica_num=2, preferred_segments=("127.0.0.1:9000", "127.0.0.1:9001"))
    assert put(core, "both", cfg=cfg) == E.OK
    for _ in range(10):
        vclock.advance(1.0)
        for c in ("c1", "c2", "w"):
            core.heartbeat(c)
        core.tick()
    vclock.advance(0.5)
    core.tick()  # c0 expired: one of two copies gone
    assert rec.calls == [("stored", "both", "cpu")]


def test_translated_into_vllm_events(vclock: VirtualClock) -> None:
    events: list[object] = []
    core = core_with(PoolEventTranslator(events.append, block_size=16), vclock)
    assert put(core, block_key(7, tp=0)) == E.OK
    assert put(core, block_key(7, tp=1)) == E.OK
    assert put(core, "other") == E.OK
    core.remove([block_key(7, tp=0)])
    assert core.remove_all() == 2
    assert events == [BlockStored(block_hashes=[7], token_ids=[], block_size=16, medium="cpu"),
                      BlockRemoved(block_hashes=[7], medium="cpu"), AllBlocksCleared()]


def test_offload_to_disk_and_removal_from_both_tiers(vclock: VirtualClock) -> None:
    from tests.store.master.test_ssd_tiering import fill, finish, tasks, tiered_core

    core, ssd_id = tiered_core(vclock)
    rec = Recorder()
    core.objects.events = rec
    fill(core, 16)  # DRAM full
    core.tick()
    due = tasks(core, ssd_id, vclock)
    vclock.advance(2.0)
    finish(core, ssd_id, due)  # offloaded: the DRAM copy goes, the disk copy comes
    moved = sorted(t.key for t in due)
    assert moved and sorted(c[1] for c in rec.calls if c[2] == "disk") == moved
    for key in moved:
        assert rec.calls.index(("stored", key, "disk")) < rec.calls.index(("removed", key, "cpu"))
    del rec.calls[:]
    assert core.remove([moved[0]]) == [E.OK]
    assert rec.calls == [("removed", moved[0], "disk")]
