"""Copies ahead of eviction (master/tier_clean.py), the order tasks are handed out in, and
how reads are counted toward promotion, on a virtual clock with the integrity check after
each step."""

from __future__ import annotations

from dataclasses import replace

from kvpool.clock import VirtualClock
from kvpool.store.master.core import MasterCore
from kvpool.store.master.tier_tasks import DONE, LOAD, OFFLOAD, Task, TierConfig
from kvpool.store.wire.codes import ErrorCode, Tier
from tests.store.conftest import KIB
from tests.store.master.test_ssd_tiering import OBJ, fill, finish, put, tasks, tiered_core, tiers

E = ErrorCode
CLEAN = 0.25  # of 64 KiB of DRAM: the 4 coldest objects


def run_node(core: MasterCore, ssd_id: str, vclock: VirtualClock) -> list[Task]:
    """Hand out and finish every task due, as a node that keeps up would."""
    done = []
    while due := tasks(core, ssd_id, vclock):
        finish(core, ssd_id, due, DONE)
        done += due
    return done


def test_a_tick_copies_the_coldest_objects_and_keeps_them_in_dram(
        vclock: VirtualClock) -> None:
    core, ssd_id = tiered_core(vclock, clean_share=CLEAN)
    keys = fill(core, 12)                      # 48 KiB: below the watermark
    core.tick()
    due = tasks(core, ssd_id, vclock)
    assert [(t.kind, t.key, t.evict) for t in due] == [(OFFLOAD, k, False) for k in keys[:4]]
    assert core.tiering.under_way.offloading_bytes == 0 and core.tiering.under_way.num_cleaning == 4
    core.check_integrity()
    finish(core, ssd_id, due)
    assert all(tiers(core, k) == [Tier.DRAM, Tier.SSD] for k in keys[:4])
    assert core.tiering.stats.copied_ahead == 4 and core.used_bytes == 12 * OBJ
    core.tick()
    assert tasks(core, ssd_id, vclock) == []   # covered: nothing more to copy
    found = core.get_replicas([keys[0]])[0]    # a plain DRAM read, normal lease...
    assert found.code == E.OK and found.lease_ttl_s == core.config.lease_ttl_s
    core.tick()                                # ...that made it the hottest: k4 is next
    assert [(t.key, t.evict) for t in tasks(core, ssd_id, vclock)] == [(keys[4], False)]


def test_a_full_dram_takes_puts_at_once_when_victims_are_clean(vclock: VirtualClock) -> None:
    core, ssd_id = tiered_core(vclock, clean_share=CLEAN)
    keys = fill(core, 16)                      # DRAM full
    core.tick()
    run_node(core, ssd_id, vclock)             # the copies land; the tick's eviction too
    vclock.advance(2.0)
    for i in range(4):
        assert put(core, f"new{i}") == E.OK    # no NO_AVAILABLE_HANDLE, no waiting
        core.check_integrity()
    assert core.tiering.stats.dram_dropped >= 1
    assert all(k in core.objects for k in keys)
    assert tiers(core, keys[0]) == [Tier.SSD]


def test_a_victim_being_copied_is_freed_when_its_copy_lands(vclock: VirtualClock) -> None:
    core, ssd_id = tiered_core(vclock, clean_share=CLEAN)
    keys = fill(core, 12)
    core.tick()
    due = tasks(core, ssd_id, vclock)          # copies ahead, not done yet
    vclock.advance(2.0)
    assert not core.evict(2 * OBJ)             # marks two of them: nothing freed now
    assert core.tiering.under_way.offloading_bytes == 2 * OBJ and core.tiering.under_way.num_cleaning == 2
    core.check_integrity()
    finish(core, ssd_id, due)
    assert [tiers(core, k) for k in keys[:3]] == [[Tier.SSD], [Tier.SSD],
                                                  [Tier.DRAM, Tier.SSD]]
    assert core.used_bytes == 10 * OBJ and core.tiering.under_way.offloading_bytes == 0


def test_nothing_is_lost_through_five_times_dram_with_an_ample_disk(
        vclock: VirtualClock) -> None:
    """Every put succeeds at once and every object stays readable while a node that keeps
    up does the copies: the disk holds whatever DRAM lets go of."""
    core, ssd_id = tiered_core(vclock, clean_share=TierConfig().clean_share,
                               disk=512 * KIB)
    keys = [f"k{i}" for i in range(80)]        # 5 x 64 KiB of DRAM
    for i, key in enumerate(keys):
        assert put(core, key) == E.OK, key
        core.check_integrity()
        if i % 2:                              # the node runs between bursts of puts
            run_node(core, ssd_id, vclock)
            core.tick()
        vclock.advance(0.05)
    assert core.evictor.stats.objects == 0 and core.tiering.stats.disk_evicted_objects == 0
    looked = core.get_replicas(keys)
    assert [r.code for r in looked].count(E.OBJECT_NOT_FOUND) == 0
    assert {r.code for r in looked} <= {E.OK, E.REPLICA_IS_NOT_READY}
    core.check_integrity()


def test_loads_are_handed_out_before_offloads(vclock: VirtualClock) -> None:
    core, ssd_id = tiered_core(vclock, clean_share=CLEAN)
    keys = fill(core, 16)
    core.tick()
    run_node(core, ssd_id, vclock)
    vclock.advance(2.0)
    cold = next(k for k in keys if tiers(core, k) == [Tier.SSD])
    fill_more = [f"m{i}" for i in range(3)]
    for key in fill_more:
        put(core, key)
    core.tick()                                # queues copies ahead...
    assert core.get_replicas([cold])[0].code == E.REPLICA_IS_NOT_READY   # ...then a load
    due = tasks(core, ssd_id, vclock)
    assert due[0].kind == LOAD and due[0].key == cold
    assert all(t.kind != LOAD for t in due[1:])
    finish(core, ssd_id, due)


def test_a_poll_hands_out_a_bounded_number_of_bytes(vclock: VirtualClock) -> None:
    core, ssd_id = tiered_core(vclock, clean_share=1.0)
    fill(core, 12)
    core.tiering.config = replace(core.tiering.config, max_task_bytes_per_poll=3 * OBJ)
    core.tick()
    assert len(tasks(core, ssd_id, vclock)) == 3
    assert len(tasks(core, ssd_id, vclock)) == 3
    core.check_integrity()


def test_lookups_that_find_no_dram_for_a_load_are_not_counted_as_reads(
        vclock: VirtualClock) -> None:
    """Promotion counts reads that loaded (or found) a copy: a reader asking again and again
    while DRAM is full of leased objects does not promote the object by itself."""
    core, ssd_id = tiered_core(vclock, promote_after=2)
    keys = fill(core, 16)
    core.tick()
    run_node(core, ssd_id, vclock)
    vclock.advance(2.0)
    cold = next(k for k in keys if tiers(core, k) == [Tier.SSD])
    hot = [f"h{i}" for i in range(16) if put(core, f"h{i}") == E.OK]
    core.get_replicas(hot)                     # every DRAM object leased: nothing to evict
    for _ in range(5):
        assert core.get_replicas([cold])[0].code == E.REPLICA_IS_NOT_READY
        vclock.advance(0.01)
    assert cold not in core.tiering.under_way.loading and core.tiering.on_disk.reads.get(cold, 0) == 0
    vclock.advance(2.0)                        # leases over: eviction makes room...
    assert core.get_replicas([cold])[0].code == E.REPLICA_IS_NOT_READY
    run_node(core, ssd_id, vclock)
    assert cold not in core.tiering.under_way.loading and core.tiering.on_disk.reads.get(cold, 0) == 0
    assert core.get_replicas([cold])[0].code == E.REPLICA_IS_NOT_READY   # ...and it loads
    assert core.tiering.on_disk.reads[cold] == 1
    run_node(core, ssd_id, vclock)
    assert core.get_replicas([cold])[0].code == E.OK          # the same reader: transient
    assert cold in core.tiering.on_disk.transient and core.tiering.stats.promotions == 0
    assert core.get_replicas([cold])[0].code == E.OK          # a second reader: promoted
    assert core.tiering.stats.promotions == 1
    core.check_integrity()
