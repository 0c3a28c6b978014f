"""The disk tier when a segment goes: a load's DRAM target on a dropped segment stays held
(quarantined with it) while the disk node may still write it; a loaded copy whose disk is
dropped becomes a plain DRAM object that eviction can take; a drain that drops a node's disk
replica drops it through the disk tier (its file deleted, the object plain DRAM again)."""
from __future__ import annotations

from typing import Any

from kvpool.clock import VirtualClock
from kvpool.store.config import MasterConfig, ReplicateConfig
from kvpool.store.master.core import MasterCore
from kvpool.store.master.tier_tasks import DONE, LOAD, OFFLOAD
from kvpool.store.wire.codes import ErrorCode as E
from kvpool.store.wire.codes import Tier

KIB = 1024
A, B = "127.0.0.1:9000", "127.0.0.1:9001"


def _copied_ahead(clock: VirtualClock, on: str, disk_files: int,
                  **config: Any) -> tuple[MasterCore, str, str]:
    """A master with node A ("ca") and node B ("cb") mounted, a disk attached to node `on`,
    and "k" put on that node's DRAM and copied to its disk ahead of eviction: (the master,
    that node's DRAM segment id, its disk's)."""
    core = MasterCore(MasterConfig(seed=7, lease_ttl_s=1.0, **config), clock)
    ids = {}
    for client, endpoint in (("ca", A), ("cb", B)):
        code, ids[client] = core.mount_segment(client, endpoint, 0x10000, 64 * KIB)
        assert code == E.OK
    code, ssd = core.tiering.attach(on, A if on == "ca" else B, 64 * KIB, disk_files)
    assert code == E.OK
    started = core.put_start("w", ["k"], [4 * KIB], ReplicateConfig(preferred_segment=ids[on]))
    assert started[0].code == E.OK and started[0].replicas[0].segment_id == ids[on]
    assert core.put_end("w", ["k"], [123])[0] == E.OK
    core.tick()
    code, due = core.tiering.next_tasks(on, ssd)
    assert [t.kind for t in due] == [OFFLOAD]
    core.tiering.report(on, ssd, [(due[0].task_id, DONE)])
    return core, ids[on], ssd


def test_load_target_of_a_dropped_segment_is_not_reused_on_same_fence_remount() -> None:
    # an object on node B, copied to B's disk ahead of eviction
    core, b_dram, b_ssd = _copied_ahead(VirtualClock(), "cb", 1)
    # B's DRAM leaves: k is on disk only; a read loads it into A's segment
    assert core.unmount_segment("cb", b_dram) == E.OK
    assert core.get_replicas(["k"])[0].code == E.REPLICA_IS_NOT_READY
    code, due = core.tiering.next_tasks("cb", b_ssd)
    assert [t.kind for t in due] == [LOAD]
    load = due[0].wire()                      # handed to node B: it is writing A's range now
    assert load.endpoint == A
    # A leaves and comes back with the same memory under the same (no) fence
    a_id = f"{A}/{0x10000:x}"
    assert core.unmount_segment("ca", a_id) == E.OK
    assert core.mount_segment("ca", A, 0x10000, 64 * KIB)[0] == E.OK
    core.check_integrity()
    # a new put must not be given the range node B may still be writing
    got = core.put_start("w2", ["new"], [4 * KIB])[0]
    assert got.code == E.OK
    assert got.replicas[0].addr != load.addr, \
        "the LOAD target was handed to a new put while the disk node may still write it"


def test_transient_copy_left_after_disk_node_death_is_evictable() -> None:
    clock = VirtualClock()
    core, b_dram, b_ssd = _copied_ahead(clock, "cb", 1 << 20, client_ttl_s=10.0)
    clock.advance(2.0)
    assert core.evict(4 * KIB)                               # k's DRAM goes: on B's disk only
    assert [r.segment.tier for r in core.objects["k"].replicas] == [Tier.SSD]
    assert core.unmount_segment("cb", b_dram) == E.OK        # B keeps only its disk
    assert core.get_replicas(["k"])[0].code == E.REPLICA_IS_NOT_READY
    _, due = core.tiering.next_tasks("cb", b_ssd)
    assert [t.kind for t in due] == [LOAD]
    core.tiering.report("cb", b_ssd, [(due[0].task_id, DONE)])   # transient copy on A
    assert "k" in core.tiering.on_disk.transient
    # node B goes silent and is dropped with its disk
    for _ in range(6):               # a reader keeps reading k meanwhile (short leases)
        clock.advance(2.5)
        assert core.get_replicas(["k"])[0].code == E.OK
        core.heartbeat("ca")
        core.heartbeat("w")
        core.tick()
    assert "cb" not in core.clients
    obj = core.objects["k"]
    assert [r.segment.tier for r in obj.replicas] == [Tier.DRAM]
    core.check_integrity()
    used = core.used_bytes
    assert used > 0
    clock.advance(100.0)
    core.heartbeat("ca")
    core.tick()
    core.evict(64 * KIB)                                    # evict everything evictable
    assert core.used_bytes < used, \
        "k's former transient copy can be neither evicted nor expired: its DRAM is held for good"


def _drained_setup() -> tuple[MasterCore, VirtualClock, str]:
    clock = VirtualClock()
    core, _, a_ssd = _copied_ahead(clock, "ca", 2)
    assert sorted(r.segment.tier for r in core.objects["k"].replicas) == [Tier.DRAM, Tier.SSD]
    core.check_integrity()
    return core, clock, a_ssd


def _drain_all(core: MasterCore) -> None:
    assert core.drain.begin(A).code == E.OK
    for _ in range(4):
        step = core.drain.start("d", A, 100, 1 << 30)
        if step.moves:
            core.drain.end("d", [m.key for m in step.moves], [0] * len(step.moves))
        if step.done:
            break


def test_drain_keeps_the_disk_tier_consistent() -> None:
    core, clock, a_ssd = _drained_setup()
    _drain_all(core)
    obj = core.objects["k"]
    assert [r.segment.endpoint for r in obj.replicas] == [B]   # moved off A
    core.check_integrity()   # AssertionError: tiered 'k' has no disk replica


def test_eviction_after_drain_leaves_an_object_without_any_replica() -> None:
    core, clock, a_ssd = _drained_setup()
    _drain_all(core)
    assert [r.segment.endpoint for r in core.objects["k"].replicas] == [B]
    clock.advance(5.0)
    core.evict(1)                         # "k" is the only victim
    obj = core.objects.get("k")
    assert obj is None or obj.replicas, f"k is stored with no replica: {obj}"
