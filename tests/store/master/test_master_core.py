from __future__ import annotations

from kvpool.clock import VirtualClock
from kvpool.store.config import ReplicateConfig
from kvpool.store.master.core import MasterCore
from kvpool.store.wire.codes import ErrorCode as E
from kvpool.store.wire.codes import ReplicaState
from tests.store.conftest import KIB, live_for, make_core


def put(core: MasterCore, key: str, size: int = KIB, client: str = "w",
        cfg: ReplicateConfig | None = None, upsert: bool = False) -> E:
    (res,) = core.put_start(client, [key], [size], cfg or ReplicateConfig(), upsert)
    if res.code != E.OK:
        return res.code
    (end,) = core.put_end(client, [key])
    core.check_integrity()
    return end


def test_two_phase_put_hides_pending(core: MasterCore) -> None:
    (res,) = core.put_start("w", ["k"], [1000], ReplicateConfig(replica_num=2))
    assert res.code == E.OK
    assert len(res.replicas) == 2
    assert {r.endpoint for r in res.replicas} == {"127.0.0.1:9000", "127.0.0.1:9001"}
    assert all(r.state == ReplicaState.PENDING and r.size == 1000 for r in res.replicas)
    assert [r.addr for r in res.replicas] == [0x10000, 0x10000]
    core.check_integrity()
    assert core.get_replicas(["k"])[0].code == E.OBJECT_NOT_FOUND
    assert core.exists(["k"]) == [E.OBJECT_NOT_FOUND]
    assert core.put_end("other", ["k"]) == [E.OBJECT_NOT_FOUND]
    assert core.put_end("w", ["k"]) == [E.OK]
    (look,) = core.get_replicas(["k"])
    assert look.code == E.OK and look.size == 1000 and len(look.replicas) == 2
    assert look.lease_ttl_s == 10.0
    assert core.used_bytes == 2 * 1024
    core.check_integrity()


def test_revoke_frees_space(core: MasterCore) -> None:
    core.put_start("w", ["k"], [5000])
    assert core.used_bytes == 5056
    assert core.put_revoke("w", ["k"]) == [E.OK]
    assert core.put_revoke("w", ["k"]) == [E.OBJECT_NOT_FOUND]
    assert core.used_bytes == 0 and len(core.pending) == 0
    core.check_integrity()


def test_objects_are_immutable_upsert_replaces(core: MasterCore) -> None:
    assert put(core, "k", 100) == E.OK
    assert put(core, "k", 200) == E.OBJECT_ALREADY_EXISTS
    assert core.get_replicas(["k"])[0].size == 100
    core.clock.advance(11)  # type: ignore[attr-defined]
    assert put(core, "k", 300, upsert=True) == E.OK
    assert core.get_replicas(["k"])[0].size == 300
    assert core.used_bytes == 320


def test_concurrent_put_of_same_key(core: MasterCore) -> None:
    assert core.put_start("a", ["k"], [64])[0].code == E.OK
    assert core.put_start("b", ["k"], [64])[0].code == E.OBJECT_ALREADY_EXISTS


def test_lease_blocks_remove_until_expiry(core: MasterCore, vclock: VirtualClock) -> None:
    put(core, "k")
    core.get_replicas(["k"])
    assert core.remove(["k"]) == [E.OBJECT_HAS_LEASE]
    vclock.advance(9.9)
    assert core.remove(["k"]) == [E.OBJECT_HAS_LEASE]
    vclock.advance(0.2)
    assert core.remove(["k"]) == [E.OK]
    assert core.remove(["k"]) == [E.OBJECT_NOT_FOUND]
    assert core.used_bytes == 0
    core.check_integrity()


def test_forced_remove_defers_free_until_lease_ends(core: MasterCore,
                                                   vclock: VirtualClock) -> None:
    put(core, "k", 4096)
    core.get_replicas(["k"])
    assert core.remove(["k"], force=True) == [E.OK]
    assert core.exists(["k"]) == [E.OBJECT_NOT_FOUND]
    assert core.used_bytes == 4096          # a reader may still be copying
    core.check_integrity()
    vclock.advance(10.5)
    core.tick()
    assert core.used_bytes == 0
    core.check_integrity()


def test_stale_pending_put_is_discarded(core: MasterCore, vclock: VirtualClock) -> None:
    core.put_start("w", ["k"], [64])
    live_for(core, vclock, 29)
    assert "k" in core.pending
    live_for(core, vclock, 2)
    assert len(core.pending) == 0 and core.stats.discarded_puts == 1
    assert core.put_end("w", ["k"]) == [E.OBJECT_NOT_FOUND]
    assert core.used_bytes == 64          # its writer may still be copying: not reused yet
    core.check_integrity()
    live_for(core, vclock, 600, ("c0", "c1"))
    assert core.used_bytes == 0
    core.check_integrity()


def test_dead_client_loses_segments_and_puts(vclock: VirtualClock) -> None:
    core = make_core(vclock, num_segments=3)
    cfg2 = ReplicateConfig(replica_num=2, preferred_segments=("127.0.0.1:9000", "127.0.0.1:9001"))
    assert put(core, "both", cfg=cfg2) == E.OK
    assert put(core, "only0", cfg=ReplicateConfig(preferred_segment="127.0.0.1:9000")) == E.OK
    assert put(core, "only2", cfg=ReplicateConfig(preferred_segment="127.0.0.1:9002")) == E.OK
    core.put_start("w", ["inflight"], [64], ReplicateConfig(preferred_segment="127.0.0.1:9000"))
    for _ in range(10):
        vclock.advance(1.0)
        for c in ("c1", "c2", "w"):
            assert core.heartbeat(c) == E.OK
        core.tick()
    vclock.advance(0.5)
    core.tick()
    assert "c0" not in core.clients and core.stats.expired_clients == 1
    assert sorted(core.objects) == ["both", "only2"]
    assert [r.endpoint for r in core.get_replicas(["both"])[0].replicas] == ["127.0.0.1:9001"]
    assert core.put_end("w", ["inflight"]) == [E.OBJECT_NOT_FOUND]
    assert core.heartbeat("c0") == E.UNKNOWN_CLIENT
    core.check_integrity()


def test_full_pool_gives_no_space_when_nothing_evictable(vclock: VirtualClock) -> None:
    core = make_core(vclock, num_segments=1, capacity=4 * KIB)
    for i in range(4):
        assert put(core, f"k{i}", KIB) == E.OK
    core.get_replicas([f"k{i}" for i in range(4)])   # leases protect everything
    assert core.put_start("w", ["x"], [KIB])[0].code == E.NO_AVAILABLE_HANDLE
    assert core.put_start("w", ["y"], [8 * KIB])[0].code == E.NO_AVAILABLE_HANDLE
    assert core.stats.no_space == 2
    assert len(core.objects) == 4
    assert core.evictor.stats.rounds == 1      # a futile round is not repeated at once
    vclock.advance(0.06)
    assert core.put_start("w", ["z"], [KIB])[0].code == E.NO_AVAILABLE_HANDLE
    assert core.evictor.stats.rounds == 2


def test_allocation_failure_evicts_lru(vclock: VirtualClock) -> None:
    core = make_core(vclock, num_segments=1, capacity=4 * KIB, eviction_ratio=0.25)
    for i in range(4):
        assert put(core, f"k{i}", KIB) == E.OK
        vclock.advance(1)
    vclock.advance(11)
    core.get_replicas(["k0"])            # k0 becomes most recent (and leased)
    assert put(core, "new", KIB) == E.OK
    assert sorted(core.objects) == ["k0", "k2", "k3", "new"]
    assert core.evictor.stats.objects == 1


def test_watermark_eviction_order_and_pins(vclock: VirtualClock) -> None:
    core = make_core(vclock, num_segments=1, capacity=10 * KIB, high_watermark=0.5,
                     eviction_ratio=0.2)
    assert put(core, "hard", KIB, cfg=ReplicateConfig(with_hard_pin=True)) == E.OK
    assert put(core, "soft", KIB, cfg=ReplicateConfig(with_soft_pin=True)) == E.OK
    for i in range(4):
        assert put(core, f"k{i}", KIB) == E.OK
    core.tick()                          # 6/10 used > 0.5: free 2 KiB, plain objects first
    assert sorted(core.objects) == ["hard", "k2", "k3", "soft"]
    core.tick()
    assert sorted(core.objects) == ["hard", "k2", "k3", "soft"]   # 4/10 is below the mark
    core.put_start("w", ["p1", "p2"], [KIB, KIB])                # pending: never evicted
    core.remove(["k2", "k3"])
    assert put(core, "k4", 2 * KIB) == E.OK                      # 6/10 again
    core.tick()                          # first pass: k4 is plain, soft survives
    assert sorted(core.objects) == ["hard", "soft"]
    assert sorted(core.pending) == ["p1", "p2"]
    assert put(core, "k5", 2 * KIB, cfg=ReplicateConfig(with_hard_pin=True)) == E.OK
    core.tick()                          # nothing plain left: the second pass takes soft
    assert sorted(core.objects) == ["hard", "k5"]
    core.check_integrity()


def test_bad_input_gets_invalid_params(core: MasterCore) -> None:
    bad_keys = ["", "a b", "x" * 5000, "tab\t", 7, None]
    res = core.put_start("w", bad_keys, [10] * len(bad_keys))  # type: ignore[arg-type]
    assert [r.code for r in res] == [E.INVALID_PARAMS] * len(bad_keys)
    assert [r.code for r in core.put_start("w", ["a", "b", "c"], [0, -1, 1 << 41])] == \
        [E.INVALID_PARAMS] * 3
    assert [r.code for r in core.put_start("w", ["a"], [1, 2])] == [E.INVALID_PARAMS]
    assert core.put_start("w", ["a"], [1], ReplicateConfig(replica_num=9))[0].code \
        == E.INVALID_PARAMS
    assert core.exists(["", 3]) == [E.INVALID_PARAMS, E.INVALID_PARAMS]  # type: ignore[list-item]
    assert core.remove_regex("(") == E.INVALID_PARAMS
    assert core.mount_segment("c", "h:1", -5, 10)[0] == E.INVALID_PARAMS
    assert core.put_start("w", ["ok"], [10])[0].code == E.OK
    core.check_integrity()


def test_impossible_placement_is_no_space_and_evicts_nothing(core: MasterCore) -> None:
    for i in range(60):
        assert put(core, f"k{i}", KIB) == E.OK
    assert core.put_start("w", ["k"], [64], ReplicateConfig(replica_num=3))[0].code \
        == E.NO_AVAILABLE_HANDLE
    assert core.put_start("w", ["big"], [65 * KIB])[0].code == E.NO_AVAILABLE_HANDLE
    assert len(core.objects) == 60 and core.evictor.stats.objects == 0


def test_remove_all_and_regex(core: MasterCore) -> None:
    for key in ("a1", "a2", "b1"):
        put(core, key)
    core.get_replicas(["b1"])
    assert core.remove_regex("^a") == 2
    assert core.remove_all() == 0
    assert core.remove_all(force=True) == 1
    assert len(core.objects) == 0


def test_unmount_by_owner_only(core: MasterCore) -> None:
    sid = core.segment_infos()[0].segment_id
    assert core.unmount_segment("c1", sid) == E.INVALID_PARAMS
    assert core.unmount_segment("c0", "nope") == E.SEGMENT_NOT_FOUND
    assert core.unmount_segment("c0", sid) == E.OK
    assert core.capacity_bytes == 64 * KIB
    core.check_integrity()


def test_batch_fast_path_places_a_run_and_falls_back(vclock: VirtualClock) -> None:
    core = make_core(vclock, num_segments=2, capacity=16 * KIB)
    res = core.put_start("w", ["a", "b", "c"], [100, 64, 1000])
    addrs = [r.replicas[0].addr for r in res]
    assert [r.code for r in res] == [E.OK] * 3
    assert len({r.replicas[0].endpoint for r in res}) == 1       # one segment, one run
    assert [a - addrs[0] for a in addrs] == [0, 128, 192]
    core.check_integrity()
    mixed = core.put_start("w", ["d", "", "a", "e"], [64, 64, 64, 64])   # declines the run
    assert [r.code for r in mixed] == [E.OK, E.INVALID_PARAMS, E.OBJECT_ALREADY_EXISTS, E.OK]
    dup = core.put_start("w", ["f", "f"], [64, 64])
    assert [r.code for r in dup] == [E.OK, E.OBJECT_ALREADY_EXISTS]
    free = [s.allocator.largest_free for s in core.segments.values()]
    assert max(free) < 21 * KIB                                  # no range for a 21 KiB run
    big = core.put_start("w", [f"g{i}" for i in range(3)], [7 * KIB] * 3)
    assert [r.code for r in big] == [E.OK] * 3                   # placed one by one
    core.check_integrity()


def test_batch_put_end_publishes_a_run_and_falls_back(vclock: VirtualClock) -> None:
    core = make_core(vclock, num_segments=2, capacity=16 * KIB)
    core.put_start("w", ["a", "b", "c"], [100, 64, 1000], ReplicateConfig(with_soft_pin=True))
    core.put_start("x", ["d"], [64])
    assert core.put_end("w", ["a", "b"], [1, 2]) == [E.OK, E.OK]            # the run
    assert [o.checksum for o in core.get_replicas(["a", "b"])] == [1, 2]
    assert core.objects["a"].soft_pin_until == vclock.now() + core.config.soft_pin_ttl_s
    assert core.segments.placeable()[0].pending_keys | core.segments.placeable()[1] \
        .pending_keys == {"c", "d"}
    core.check_integrity()
    assert core.put_end("w", ["c", "d"], [3, 4]) == [E.OK, E.OBJECT_NOT_FOUND]  # not w's
    assert core.put_end("x", ["d", "d"], [4, 4]) == [E.OK, E.OBJECT_NOT_FOUND]  # twice
    core.put_start("w", ["e", "f", "g"], [64, 64, 64])
    assert core.put_end("w", ["e", "f"], [5, True]) == [E.OK, E.INVALID_PARAMS]
    assert core.put_end("w", ["f", "g"], [None, 1 << 64]) == [E.OK, E.INVALID_PARAMS]
    assert core.put_end("w", ["g"], [7]) == [E.OK]
    core.put_start("w", ["a", "h"], [64, 64], upsert=True)
    assert core.put_end("w", ["a", "h"], [9, 9]) == [E.OK, E.OK]       # replaces "a"
    assert core.get_replicas(["a"])[0].checksum == 9
    assert not core.pending
    core.check_integrity()


def test_put_end_records_checksums_and_lookups_return_them(core: MasterCore) -> None:
    core.put_start("w", ["a", "b", "c", "d"], [100, 100, 100, 100])
    assert core.put_end("w", ["a"], [1, 2]) == [E.INVALID_PARAMS]      # lengths differ
    assert core.put_end("w", ["a", "b", "c", "d"], [0xDEADBEEF, None, -1, 1 << 64]) == [
        E.OK, E.OK, E.INVALID_PARAMS, E.INVALID_PARAMS]
    assert [x.checksum for x in core.get_replicas(["a", "b", "c"])] == [0xDEADBEEF, None, None]
    assert core.put_end("w", ["c", "d"], [(1 << 64) - 1, 5]) == [E.OK, E.OK]
    assert core.get_replicas(["c"])[0].checksum == (1 << 64) - 1
    (res,) = core.put_start("w", ["a"], [100], upsert=True)
    assert core.put_end("w", ["a"], [7]) == [E.OK]
    assert core.get_replicas(["a"])[0].checksum == 7                # upsert replaces it
    core.check_integrity()


def test_the_masters_own_stall_is_grace_not_everyones_death(core: MasterCore,
                                                            vclock: VirtualClock) -> None:
    assert put(core, "k", 100) == E.OK
    core.put_start("w", ["p"], [64])
    live_for(core, vclock, 4)
    vclock.advance(15)                    # SIGSTOP: no tick, no heartbeat read for 15 s
    core.tick()
    assert sorted(core.clients) == ["c0", "c1", "w"] and core.stats.expired_clients == 0
    assert core.stats.stalls_forgiven == 1 and "p" in core.pending
    assert core.get_replicas(["k"])[0].code == E.OK
    core.check_integrity()
    live_for(core, vclock, 9, ("c0", "w"))   # after the stall, ordinary silence counts again
    assert "c1" in core.clients
    live_for(core, vclock, 2, ("c0", "w"))
    assert sorted(core.clients) == ["c0", "w"] and core.stats.expired_clients == 1
    assert core.stats.stalls_forgiven == 1
    core.check_integrity()


def test_a_short_gap_between_ticks_is_no_stall(core: MasterCore, vclock: VirtualClock) -> None:
    live_for(core, vclock, 7.5, ("c0",))
    vclock.advance(4.9)                   # under client_ttl / 2: c1's silence is its own
    core.tick()
    assert core.stats.stalls_forgiven == 0 and sorted(core.clients) == ["c0"]


def test_ranges_a_late_writer_may_hold_survive_a_remount(vclock: VirtualClock) -> None:
    core = make_core(vclock, num_segments=1, capacity=4 * KIB)
    (started,) = core.put_start("w", ["a"], [KIB])
    assert put(core, "b", KIB) == E.OK
    live_for(core, vclock, 11, ("w",))             # c0 (the node) stalls and is expired
    assert len(core.segments) == 0 and len(core.pending) == 0
    code, sid = core.mount_segment("c0", "127.0.0.1:9000", 0x10000, 4 * KIB)
    assert code == E.OK
    assert core.used_bytes == KIB                  # a's range is still held, b's is free
    (again,) = core.put_start("w", ["c"], [3 * KIB])
    assert again.code == E.OK and started.replicas[0].addr not in {r.addr for r in again.replicas}
    core.check_integrity()
    live_for(core, vclock, 600, ("w", "c0"))
    assert core.used_bytes == 3 * KIB and core.space.num_quarantined() == 0
    core.check_integrity()


def test_a_new_fence_starts_the_memory_empty(vclock: VirtualClock) -> None:
    core = make_core(vclock, num_segments=0)
    assert core.mount_segment("n", "127.0.0.1:9000", 0x10000, 4 * KIB, fence=11) == (
        E.OK, "127.0.0.1:9000/10000")
    (started,) = core.put_start("w", ["a"], [KIB])
    assert [r.fence for r in started.replicas] == [11]
    assert put(core, "b", KIB) == E.OK
    assert [r.fence for r in core.get_replicas(["b"])[0].replicas] == [11]
    assert core.mount_segment("n", "127.0.0.1:9000", 0x10000, 4 * KIB, fence=11)[0] == E.OK
    assert core.get_replicas(["b"])[0].code == E.OK           # the same mount: idempotent
    assert core.mount_segment("n", "127.0.0.1:9000", 0x10000, 4 * KIB, fence=12)[0] == E.OK
    assert core.get_replicas(["b"])[0].code == E.OBJECT_NOT_FOUND
    assert len(core.pending) == 0 and core.used_bytes == 0         # old writers are fenced out
    assert core.mount_segment("n", "h:1", 0, KIB, fence=1 << 64)[0] == E.INVALID_PARAMS
    core.check_integrity()


def test_leases_only_grow_through_the_object_table(core: MasterCore,
                                                   vclock: VirtualClock) -> None:
    """`extend_lease` never shortens a lease: a lookup's 10 s lease does not cut a longer one
    short, and a later lookup extends it from its own time."""
    put(core, "k")
    obj = core.objects["k"]
    t0 = vclock.now()
    assert obj.lease_until == 0.0
    core.objects.extend_lease(obj, t0 + 50.0)
    core.objects.extend_lease(obj, t0 + 20.0)
    assert obj.lease_until == t0 + 50.0
    core.get_replicas(["k"])                 # t0 + 10 < t0 + 50: unchanged
    assert obj.lease_until == t0 + 50.0
    vclock.advance(45.0)
    core.get_replicas(["k"])
    assert obj.lease_until == t0 + 55.0
    vclock.advance(9.9)
    assert core.remove(["k"]) == [E.OBJECT_HAS_LEASE]
    vclock.advance(0.2)
    assert core.remove(["k"]) == [E.OK]
    core.check_integrity()


def test_a_leased_range_on_a_dropped_segment_is_not_handed_out_under_the_lease(
        vclock: VirtualClock) -> None:
    """A reader looked the object up (its lease runs) just before the node was dropped; the
    same memory mounted again under the same fence keeps that range until the lease ends."""
    core = make_core(vclock)
    c0 = "127.0.0.1:9000/10000"
    assert core.put_start("w", ["obj"], [KIB], ReplicateConfig(preferred_segment=c0))[0].code \
        == E.OK
    assert core.put_end("w", ["obj"], [1]) == [E.OK]
    live_for(core, vclock, core.config.client_ttl_s - 1, clients=("w", "c1"), step=1.0)
    (look,) = core.get_replicas(["obj"])
    leased, lease_ends = look.replicas[0].addr, vclock.now() + look.lease_ttl_s
    live_for(core, vclock, 2, clients=("w", "c1"), step=1.0)     # c0 is dropped
    assert c0 not in core.segments
    assert core.heartbeat("c0") != E.OK
    assert core.mount_segment("c0", "127.0.0.1:9000", 0x10000, 64 * KIB, fence=0)[0] == E.OK
    assert vclock.now() < lease_ends
    (new,) = core.put_start("w", ["new"], [KIB], ReplicateConfig(preferred_segment=c0))
    assert new.code == E.OK and new.replicas[0].addr != leased
    core.check_integrity()
