"""The master's side of the disk tier on a virtual clock: offload, load, promotion, disk
eviction, registration, removal and dead nodes, with the integrity check after each step."""

from __future__ import annotations

from dataclasses import replace

from kvpool.clock import VirtualClock
from kvpool.store.master.core import MasterCore
from kvpool.store.master.tier_tasks import DELETE, DONE, FAILED, FILE_BAD, LOAD, OFFLOAD, Task
from kvpool.store.wire.codes import ErrorCode, Tier
from tests.store.conftest import KIB, live_for, make_core

E = ErrorCode
OBJ = 4 * KIB


def tiered_core(clock: VirtualClock, promote_after: int = 2, disk: int = 64 * KIB,
                clean_share: float = 0.0) -> tuple[MasterCore, str]:
    """One node c0 with 64 KiB of DRAM and `disk` bytes of disk; lease 1 s. Copies ahead of
    eviction are off unless `clean_share` says otherwise (test_ssd_clean.py covers them)."""
    core = make_core(clock, num_segments=1, lease_ttl_s=1.0)
    core.tiering.config = replace(core.tiering.config, clean_share=clean_share)
    code, ssd_id = core.tiering.attach("c0", "127.0.0.1:9000", disk, promote_after)
    assert code == E.OK and ssd_id == "127.0.0.1:9000/0"
    core.check_integrity()
    return core, ssd_id


def put(core: MasterCore, key: str, size: int = OBJ) -> ErrorCode:
    started = core.put_start("w", [key], [size])[0]
    if started.code != E.OK:
        return started.code
    return core.put_end("w", [key], [hash(key) & 0xFFFF])[0]


def tasks(core: MasterCore, ssd_id: str, clock: VirtualClock) -> list[Task]:
    code, due = core.tiering.next_tasks("c0", ssd_id)
    assert code == E.OK
    return due


def finish(core: MasterCore, ssd_id: str, due: list[Task], status: int = DONE) -> None:
    assert core.tiering.report("c0", ssd_id, [(t.task_id, status) for t in due]) == E.OK
    core.check_integrity()


def tiers(core: MasterCore, key: str) -> list[Tier]:
    return sorted(r.segment.tier for r in core.objects[key].replicas)


def fill(core: MasterCore, n: int) -> list[str]:
    keys = [f"k{i}" for i in range(n)]
    for key in keys:
        assert put(core, key) == E.OK
        core.check_integrity()
    return keys


def test_eviction_offloads_and_the_object_stays_readable(vclock: VirtualClock) -> None:
    core, ssd_id = tiered_core(vclock)
    fill(core, 16)                       # 64 KiB: DRAM is full
    core.tick()                          # above the watermark: offload, nothing dropped
    due = tasks(core, ssd_id, vclock)
    assert due and {t.kind for t in due} == {OFFLOAD}
    assert len(core.objects) == 16 and core.tiering.under_way.offloading_bytes == len(due) * OBJ
    assert core.get_replicas([due[0].key])[0].code == E.OK   # still served from DRAM
    assert tasks(core, ssd_id, vclock) == []                 # handed out once
    core.check_integrity()
    vclock.advance(2.0)                  # the lease above ends
    finish(core, ssd_id, due)
    assert tiers(core, due[0].key) == [Tier.SSD]
    assert core.tiering.stats.offloads == len(due) and core.tiering.under_way.offloading_bytes == 0
    assert core.used_bytes == (16 - len(due)) * OBJ


def test_a_put_never_waits_for_the_disk(vclock: VirtualClock) -> None:
    core, ssd_id = tiered_core(vclock)
    fill(core, 16)
    results = [put(core, f"x{i}") for i in range(8)]   # offloads queued, none done
    assert set(results) <= {E.OK, E.NO_AVAILABLE_HANDLE}
    assert E.NO_AVAILABLE_HANDLE in results
    core.check_integrity()
    finish(core, ssd_id, tasks(core, ssd_id, vclock))
    assert put(core, "after") == E.OK


def offloaded(vclock: VirtualClock, promote_after: int = 2) -> tuple[MasterCore, str, str]:
    core, ssd_id = tiered_core(vclock, promote_after)
    fill(core, 16)
    core.tick()
    due = tasks(core, ssd_id, vclock)
    finish(core, ssd_id, due)
    return core, ssd_id, due[0].key


def load(core: MasterCore, ssd_id: str, key: str, vclock: VirtualClock) -> None:
    assert core.get_replicas([key])[0].code == E.REPLICA_IS_NOT_READY
    assert core.get_replicas([key])[0].code == E.REPLICA_IS_NOT_READY  # one load only
    due = tasks(core, ssd_id, vclock)
    assert [t.kind for t in due] == [LOAD] and due[0].key == key
    core.check_integrity()
    finish(core, ssd_id, due)


def test_a_disk_only_read_loads_a_transient_copy(vclock: VirtualClock) -> None:
    core, ssd_id, key = offloaded(vclock, promote_after=5)
    load(core, ssd_id, key, vclock)
    found = core.get_replicas([key])[0]
    assert found.code == E.OK
    assert sorted(r.tier for r in found.replicas) == [Tier.DRAM, Tier.SSD]
    assert key in core.tiering.on_disk.transient
    vclock.advance(2.0)
    core.tick()                          # lease over: the transient copy goes
    assert tiers(core, key) == [Tier.SSD]
    core.check_integrity()


def test_promotion_after_k_reads(vclock: VirtualClock) -> None:
    core, ssd_id, key = offloaded(vclock, promote_after=2)
    load(core, ssd_id, key, vclock)      # read 1: a transient copy...
    assert core.get_replicas([key])[0].lease_ttl_s == core.tiering.config.transient_lease_s
    assert key in core.tiering.on_disk.transient and core.tiering.stats.promotions == 0
    vclock.advance(3.0)
    core.tick()                          # ...gone with its lease
    assert tiers(core, key) == [Tier.SSD]
    load(core, ssd_id, key, vclock)      # read 2: promoted when it arrives
    assert key not in core.tiering.on_disk.transient and core.tiering.stats.promotions == 1
    vclock.advance(3.0)
    core.tick()
    assert tiers(core, key) == [Tier.DRAM, Tier.SSD]
    core.evict(64 * KIB)                 # evicting it again needs no copy
    assert tiers(core, key) == [Tier.SSD] and core.tiering.stats.dram_dropped >= 1
    core.check_integrity()


def test_a_second_reader_of_a_transient_copy_promotes_it(vclock: VirtualClock) -> None:
    core, ssd_id, key = offloaded(vclock, promote_after=2)
    load(core, ssd_id, key, vclock)
    assert core.get_replicas([key])[0].code == E.OK      # the first reader, again
    assert key in core.tiering.on_disk.transient
    assert core.get_replicas([key])[0].code == E.OK      # someone else
    assert key not in core.tiering.on_disk.transient and core.tiering.stats.promotions == 1
    core.check_integrity()


def test_promote_after_one_keeps_every_load(vclock: VirtualClock) -> None:
    core, ssd_id, key = offloaded(vclock, promote_after=1)
    load(core, ssd_id, key, vclock)
    assert core.tiering.stats.promotions == 1 and key not in core.tiering.on_disk.transient


def test_a_failed_load_drops_the_bad_disk_copy(vclock: VirtualClock) -> None:
    core, ssd_id, key = offloaded(vclock)
    assert core.get_replicas([key])[0].code == E.REPLICA_IS_NOT_READY
    finish(core, ssd_id, tasks(core, ssd_id, vclock), status=FILE_BAD)
    assert key not in core.objects and core.tiering.stats.load_failures == 1
    assert [t.kind for t in tasks(core, ssd_id, vclock)] == [DELETE]


def test_a_load_that_failed_for_other_reasons_keeps_the_disk_copy(
        vclock: VirtualClock) -> None:
    core, ssd_id, key = offloaded(vclock)
    assert core.get_replicas([key])[0].code == E.REPLICA_IS_NOT_READY
    finish(core, ssd_id, tasks(core, ssd_id, vclock), status=FAILED)
    assert tiers(core, key) == [Tier.SSD]
    load(core, ssd_id, key, vclock)      # the next read tries again
    assert core.get_replicas([key])[0].code == E.OK


def test_remove_deletes_the_file_and_a_removed_offload_is_undone(
        vclock: VirtualClock) -> None:
    core, ssd_id, key = offloaded(vclock)
    assert core.remove([key]) == [E.OK]
    due = tasks(core, ssd_id, vclock)
    assert [(t.kind, t.key) for t in due] == [(DELETE, key)]
    finish(core, ssd_id, due)
    fill_more = [f"y{i}" for i in range(4)]
    for k in fill_more:
        put(core, k)
    core.tick()
    due = tasks(core, ssd_id, vclock)
    victim = next(t for t in due if t.kind == OFFLOAD)
    assert core.remove([victim.key], force=True) == [E.OK]
    core.check_integrity()
    finish(core, ssd_id, due)            # done after all: its file is deleted again
    assert victim.key not in core.objects
    assert (DELETE, victim.key) in [(t.kind, t.key) for t in tasks(core, ssd_id, vclock)]


def test_disk_watermark_evicts_least_recently_used(vclock: VirtualClock) -> None:
    core, ssd_id = tiered_core(vclock, disk=16 * KIB)
    keys = fill(core, 16)
    for round_ in range(6):
        core.tick()
        finish(core, ssd_id, tasks(core, ssd_id, vclock))
        vclock.advance(0.1)
        put(core, f"z{round_}")
    core.tick()
    ssd = core.segments[ssd_id]
    assert len(ssd.keys) * OBJ <= 0.95 * ssd.capacity   # (plus one offload in flight)
    assert core.tiering.stats.disk_evicted_objects > 0
    assert keys[0] not in core.objects   # oldest gone from disk, and so from the store
    core.check_integrity()


def test_registration_after_a_node_restart(vclock: VirtualClock) -> None:
    core = make_core(vclock, num_segments=1)
    assert put(core, "same") == E.OK
    checksum = core.objects["same"].checksum
    _, ssd_id = core.tiering.attach("c0", "127.0.0.1:9000", 64 * KIB, 2)
    codes = core.tiering.register("c0", ssd_id, ["new", "same", "same2", "bad key"],
                                  [OBJ, OBJ, OBJ, OBJ], [1, checksum, 3, 4], [7, 8, 9, 10])
    assert codes == [E.OK, E.OK, E.OK, E.INVALID_PARAMS]
    assert tiers(core, "new") == [Tier.SSD] and tiers(core, "same") == [Tier.DRAM, Tier.SSD]
    codes = core.tiering.register("c0", ssd_id, ["same"], [OBJ], [checksum ^ 1], [1])
    assert codes == [E.OBJECT_ALREADY_EXISTS]
    core.check_integrity()
    assert core.tiering.register("c9", ssd_id, ["x"], [1], [1], [1]) == [E.SEGMENT_NOT_FOUND]


def test_a_dead_node_takes_its_disk_and_tasks(vclock: VirtualClock) -> None:
    core, ssd_id, key = offloaded(vclock)
    assert core.get_replicas([key])[0].code == E.REPLICA_IS_NOT_READY
    vclock.advance(core.config.client_ttl_s + 1)
    core.heartbeat("w")
    core.expire_clients()
    assert key not in core.objects and not core.tiering.mounts
    assert not core.tiering.on_disk.tiered and not core.tiering.under_way.loading
    core.check_integrity()


def test_lost_task_replies_are_handed_out_again(vclock: VirtualClock) -> None:
    core, ssd_id = tiered_core(vclock)
    fill(core, 16)
    core.tick()
    first = tasks(core, ssd_id, vclock)
    vclock.advance(core.tiering.config.redeliver_s + 0.1)
    assert [t.task_id for t in tasks(core, ssd_id, vclock)] == [t.task_id for t in first]
    finish(core, ssd_id, first)
    finish(core, ssd_id, first)          # a duplicate report changes nothing


def test_a_dram_segment_dropped_under_an_offload(vclock: VirtualClock) -> None:
    core, ssd_id = tiered_core(vclock)
    fill(core, 16)
    core.tick()
    due = tasks(core, ssd_id, vclock)
    dram_id = next(s for s in core.segments if s != ssd_id)
    assert core.unmount_segment("c0", dram_id) == E.OK   # the objects go with it
    core.check_integrity()
    assert not core.tiering.under_way.offloading and core.segments[ssd_id].allocator.used_bytes == 0
    deletes = tasks(core, ssd_id, vclock)                # files the node may still write
    assert {(t.kind, t.key) for t in deletes} == {(DELETE, t.key) for t in due}
    finish(core, ssd_id, due + deletes)


def test_a_load_target_dropped_holds_its_range(vclock: VirtualClock) -> None:
    core, ssd_id, key = offloaded(vclock)
    code, other = core.mount_segment("c1", "127.0.0.1:9001", 0x10000, 64 * KIB)
    assert code == E.OK
    assert core.get_replicas([key])[0].code == E.REPLICA_IS_NOT_READY
    load_task = core.tiering.under_way.loading[key]
    assert load_task.dram is not None
    target = load_task.dram.segment
    core._drop_segment(target)
    core.check_integrity()
    assert key not in core.tiering.under_way.loading and tiers(core, key) == [Tier.SSD]
    finish(core, ssd_id, tasks(core, ssd_id, vclock))   # the late report changes nothing
    assert tiers(core, key) == [Tier.SSD]


def disk_of_another_node(core: MasterCore) -> str:
    code, ssd_id = core.tiering.attach("d0", "127.0.0.1:9100", 64 * KIB, 2)
    assert code == E.OK
    return ssd_id


def lose_disk_node(core: MasterCore, vclock: VirtualClock) -> None:
    """d0 stops heartbeating until the master drops it; the others stay."""
    live_for(core, vclock, core.config.client_ttl_s + 5, clients=("w", "c0"))
    assert not core.tiering.mounts
    core.check_integrity()


def test_a_file_whose_delete_was_not_run_is_refused_when_its_node_returns(
        vclock: VirtualClock) -> None:
    """Removed while its node was down: the DELETE goes with the node, the file stays on
    its disk. When the node mounts again its registration of that file is refused (the
    node deletes it), so the removed value never comes back."""
    core, ssd_id, key = offloaded(vclock)
    gen = core.tiering.on_disk.gens[(ssd_id, key)]
    checksum = core.objects[key].checksum
    assert core.remove([key], force=True) == [E.OK]
    vclock.advance(core.config.client_ttl_s + 1)
    core.heartbeat("w")
    core.expire_clients()                      # before the node ran its DELETE
    assert not core.tiering.mounts
    core.check_integrity()
    code, again = core.tiering.attach("c0", "127.0.0.1:9000", 64 * KIB, 2)
    assert code == E.OK
    assert core.tiering.register("c0", again, [key], [OBJ], [checksum], [gen]) \
        == [E.OBJECT_ALREADY_EXISTS]
    assert key not in core.objects
    core.check_integrity()


def test_a_file_left_on_a_lost_disk_comes_back_only_while_its_value_stands(
        vclock: VirtualClock) -> None:
    """An object in DRAM with a copy on d0's disk; d0 is lost. If nobody removed or
    replaced the object meanwhile its file is taken back; if they did, it is refused."""
    core = make_core(vclock, num_segments=1)
    ssd_id = disk_of_another_node(core)
    for key in ("kept", "removed", "replaced"):
        assert put(core, key) == E.OK
    sums = {k: core.objects[k].checksum for k in core.objects}
    gens = {"kept": 11, "removed": 12, "replaced": 13}
    assert core.tiering.register("d0", ssd_id, list(gens), [OBJ] * 3,
                                 [sums[k] for k in gens], list(gens.values())) == [E.OK] * 3
    lose_disk_node(core, vclock)
    assert sorted(core.objects) == ["kept", "removed", "replaced"]   # DRAM copies stay
    assert core.remove(["removed"], force=True) == [E.OK]
    started = core.put_start("w", ["replaced"], [OBJ], upsert=True)[0]
    assert started.code == E.OK
    assert core.put_end("w", ["replaced"], [sums["replaced"]]) == [E.OK]  # same checksum
    ssd_id = disk_of_another_node(core)
    codes = core.tiering.register("d0", ssd_id, list(gens), [OBJ] * 3,
                                  [sums[k] for k in gens], list(gens.values()))
    assert codes == [E.OK, E.OBJECT_ALREADY_EXISTS, E.OBJECT_ALREADY_EXISTS]
    assert "removed" not in core.objects
    assert tiers(core, "replaced") == [Tier.DRAM]
    core.check_integrity()
