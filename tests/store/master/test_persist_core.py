"""Persistence on a virtual clock: records, torn tails, replay, re-attach and the grace."""

from __future__ import annotations

from pathlib import Path

from kvpool.clock import VirtualClock
from kvpool.errors import JournalWriteError
from kvpool.store.config import MasterConfig, ReplicateConfig
from kvpool.store.master.core import MasterCore
from kvpool.store.master.persist import Journal, PersistConfig, load_state
from kvpool.store.master.records import DurableState, decode_frames, encode_record
from kvpool.store.wire.codes import ErrorCode as E

KIB = 1024


def open_core(clock: VirtualClock, state_dir: Path, grace_s: float = 30.0) -> MasterCore:
    core = MasterCore(MasterConfig(seed=7), clock)
    core.journal = Journal(PersistConfig(str(state_dir), recovery_grace_s=grace_s), core)
    return core


def mount(core: MasterCore, i: int, fence: int, client: str | None = None) -> str:
    code, sid = core.mount_segment(client or f"c{i}", f"127.0.0.1:{9000 + i}", 0x10000,
                                   64 * KIB, fence=fence)
    assert code == E.OK
    return sid


def put(core: MasterCore, key: str, size: int = KIB, replicas: int = 1,
        checksum: int = 7) -> None:
    (res,) = core.put_start("w", [key], [size], ReplicateConfig(replica_num=replicas))
    assert res.code == E.OK
    assert core.put_end("w", [key], [checksum]) == [E.OK]
    assert core.journal is not None
    core.journal.commit()


def test_frames_round_trip_and_torn_tail_is_dropped() -> None:
    data = encode_record(["R", "a"]) + encode_record(["R", "b"])
    assert decode_frames(data) == ([["R", "a"], ["R", "b"]], len(data))
    for cut in range(len(data)):
        records, used = decode_frames(data[:cut])
        assert records == [["R", "a"], ["R", "b"]][:len(records)]
        assert used <= cut
    flipped = bytearray(data)
    flipped[-1] ^= 1
    assert decode_frames(bytes(flipped))[0] == [["R", "a"]]


def test_state_replays_puts_removes_and_drops() -> None:
    state = DurableState()
    for rec in (["S", "s1", "c1", "e1", 0, 100, 0, 5], ["S", "s2", "c2", "e2", 0, 100, 0, 6],
                ["P", "a", 10, [["s1", 0], ["s2", 0]], 1, False], ["P", "b", 10, [["s1", 64]],
                                                                   None, True],
                ["R", "x"], ["D", "s1"], ["S", "s2", "c2", "e2", 0, 100, 0, 9]):
        state.apply(rec)
    assert set(state.objects) == {"a"}
    assert state.objects["a"].replicas == (("s2", 0),)
    assert state.segments["s2"].fence == 9
    state.apply(["S", "s2", "other", "e2", 0, 100, 0, 9])  # different memory
    assert state.objects == {}


def test_restart_serves_objects_once_their_node_mounts_again(tmp_path: Path) -> None:
    clock = VirtualClock()
    core = open_core(clock, tmp_path)
    sids = [mount(core, 0, 11), mount(core, 1, 12)]
    for i in range(20):
        put(core, f"k{i}", KIB + i, replicas=1 + i % 2, checksum=i)
    core.remove(["k0"], force=True)
    core.journal.commit()  # type: ignore[union-attr]  # the service does, before replying
    want = {k: core.get_replicas([k])[0] for k in core.objects}
    # a new master on the same directory (the old one died without a word)
    clock.advance(1)
    core2 = open_core(clock, tmp_path)
    assert core2.get_replicas(["k1"])[0].code == E.OBJECT_NOT_FOUND
    mount(core2, 0, 21)   # same node process, new fence
    core2.check_integrity()
    on_seg0 = [k for k, look in want.items() if any(r.fence == 11 for r in look.replicas)]
    elsewhere = set(want) - set(on_seg0)
    assert on_seg0 and elsewhere
    for key in on_seg0:
        (one,) = core2.get_replicas([key])
        assert one.code == E.OK and one.checksum == want[key].checksum
        assert [r.fence for r in one.replicas] == [21]
    assert all(core2.get_replicas([k])[0].code == E.OBJECT_NOT_FOUND for k in elsewhere)
    mount(core2, 1, 22)
    core2.check_integrity()
    assert set(core2.objects) == set(want) and "k0" not in core2.objects
    for key, old in want.items():
        (new,) = core2.get_replicas([key])
        assert (new.size, new.checksum) == (old.size, old.checksum)
        assert sorted(r.addr for r in new.replicas) == sorted(r.addr for r in old.replicas)
    # fresh puts never land on recovered ranges
    for i in range(10):
        put(core2, f"new{i}")
    core2.check_integrity()
    assert sids == sorted(core2.segments)


def test_a_segment_that_does_not_come_back_is_dropped_after_the_grace(tmp_path: Path) -> None:
    clock = VirtualClock()
    core = open_core(clock, tmp_path)
    mount(core, 0, 11), mount(core, 1, 12)
    for i in range(6):
        put(core, f"k{i}")
    on_seg1 = {k for k, o in core.objects.items() if o.replicas[0].segment.endpoint.endswith(
        "9001")}
    core2 = open_core(clock, tmp_path, grace_s=5)
    mount(core2, 0, 21)
    mount(core2, 1, 22, client="another-process")  # same address, other memory: empty
    assert set(core2.objects) == set(core.objects) - on_seg1
    core2.check_integrity()
    clock.advance(6)
    core2.heartbeat("c0"), core2.heartbeat("another-process")
    core2.tick()
    assert core2.journal is not None and core2.journal.recovery.done
    state, _ = load_state(tmp_path)
    assert set(state.objects) == set(core.objects) - on_seg1


def test_unreturned_segment_expires(tmp_path: Path) -> None:
    clock = VirtualClock()
    core = open_core(clock, tmp_path)
    mount(core, 0, 11)
    put(core, "k")
    core2 = open_core(clock, tmp_path, grace_s=5)
    clock.advance(6)
    core2.tick()
    assert load_state(tmp_path)[0].objects == {}
    core3 = open_core(clock, tmp_path)
    mount(core3, 0, 11)
    assert len(core3.objects) == 0


def test_torn_log_tail_is_ignored_at_replay(tmp_path: Path) -> None:
    clock = VirtualClock()
    core = open_core(clock, tmp_path)
    mount(core, 0, 11)
    put(core, "a")
    put(core, "b")
    (log_file,) = tmp_path.glob("log.*")
    data = log_file.read_bytes()
    log_file.write_bytes(data[:-3])   # the record of "b" torn mid-write
    core2 = open_core(clock, tmp_path)
    mount(core2, 0, 11)
    assert set(core2.objects) == {"a"}
    core2.check_integrity()


def test_compaction_keeps_the_state(tmp_path: Path) -> None:
    clock = VirtualClock()
    core = MasterCore(MasterConfig(seed=7), clock)
    core.journal = Journal(PersistConfig(str(tmp_path), compact_bytes=1024), core)
    mount(core, 0, 11)
    for i in range(40):
        put(core, f"k{i}", 256)
        if i % 3 == 0:
            core.remove([f"k{i}"], force=True)
        core.tick()  # commits too
    assert len(list(tmp_path.glob("log.*"))) == 1
    state, _ = load_state(tmp_path)
    assert set(state.objects) == set(core.objects)


def test_remove_during_recovery_is_final(tmp_path: Path) -> None:
    clock = VirtualClock()
    core = open_core(clock, tmp_path)
    mount(core, 0, 11), mount(core, 1, 12)
    put(core, "two", replicas=2)
    put(core, "one")
    core2 = open_core(clock, tmp_path)
    assert core2.remove(["one"]) == [E.OK]
    mount(core2, 0, 21)
    assert core2.remove(["two"], force=True) == [E.OK]   # back with one replica: removed
    mount(core2, 1, 22)                                  # its other replica stays gone
    assert len(core2.objects) == 0
    core2.check_integrity()
    assert core2.journal is not None
    core2.journal.commit()
    assert load_state(tmp_path)[0].objects == {}


def live_and_replayed(core: MasterCore, state_dir: Path) -> tuple[set[str], set[str]]:
    assert core.journal is not None
    assert core.journal.commit()
    return set(core.objects), set(load_state(state_dir)[0].objects)


def test_a_key_put_again_and_removed_during_recovery_stays_removed(tmp_path: Path) -> None:
    """Its old value, recorded on a segment that mounts only later, does not come back."""
    clock = VirtualClock()
    core = open_core(clock, tmp_path)
    mount(core, 0, 11), mount(core, 1, 12)
    (res,) = core.put_start("w", ["k"], [KIB], ReplicateConfig(
        preferred_segment="127.0.0.1:9000/10000"))
    assert core.put_end("w", ["k"], [1]) == [E.OK]
    assert core.journal is not None and core.journal.commit()
    core2 = open_core(clock, tmp_path)
    mount(core2, 1, 22)
    put(core2, "k", checksum=2)                     # on segment 1: the old value is gone
    assert core2.remove(["k"], force=True) == [E.OK]
    mount(core2, 0, 21)                             # the old value's segment
    assert live_and_replayed(core2, tmp_path) == (set(), set())
    core2.check_integrity()


def test_an_object_back_then_dropped_with_its_segment_is_not_replayed_on_another(
        tmp_path: Path) -> None:
    """Replicas on A and B; after a restart A mounts (the object is back), then leaves (the
    object goes with it), then B mounts: the journal must not still place the object on B,
    where the next put is given its memory."""
    clock = VirtualClock()
    core = open_core(clock, tmp_path)
    a, b = mount(core, 0, 11), mount(core, 1, 12)
    put(core, "k", replicas=2, checksum=1)
    core2 = open_core(clock, tmp_path)
    mount(core2, 0, 21)
    assert core2.unmount_segment("c0", a) == E.OK
    mount(core2, 1, 22)
    assert live_and_replayed(core2, tmp_path) == (set(), set())
    (res,) = core2.put_start("w", ["y"], [KIB], ReplicateConfig(preferred_segment=b))
    assert core2.put_end("w", ["y"], [2]) == [E.OK]
    assert live_and_replayed(core2, tmp_path) == ({"y"}, {"y"})
    core3 = open_core(clock, tmp_path)
    mount(core3, 1, 32)
    assert set(core3.objects) == {"y"} and core3.objects["y"].checksum == 2
    core3.check_integrity()


def test_a_write_that_outlasts_the_lease_is_not_acknowledged(tmp_path: Path) -> None:
    """Shared directory HA: the lease lapses while the append is under way (a pause between
    the fence check and the write): a successor may have loaded the journal already, so the
    put is refused and its memory held, not given to the next put."""
    clock = VirtualClock()
    core = open_core(clock, tmp_path)
    assert core.journal is not None
    leads = [True]
    core.journal.fence = lambda: leads[0]
    mount(core, 0, 11)
    append = core.journal.store.append

    def paused_append(records: list[bytes]) -> bool:
        leads[0] = False
        return append(records)
    core.journal.store.append = paused_append  # type: ignore[method-assign]
    (res,) = core.put_start("w", ["k"], [KIB], ReplicateConfig())
    assert core.put_end("w", ["k"], [1]) == [E.OK]
    assert not core.journal.commit()
    assert "k" not in core.objects
    (again,) = core.put_start("w", ["y"], [KIB], ReplicateConfig())
    assert again.replicas[0].addr != res.replicas[0].addr
    core.check_integrity()


def test_a_put_whose_failed_write_stayed_in_the_log_is_voided(tmp_path: Path) -> None:
    """The write failed after its records reached the file, and cutting them off failed too
    (the log store's `_dirty` case): the put is refused, and since the log may keep its
    record, its memory is held until a remove of it is written. A restart then has neither
    it nor another object on its memory."""
    clock = VirtualClock()
    core = open_core(clock, tmp_path)
    assert core.journal is not None
    mount(core, 0, 11)
    append, failures = core.journal.store.append, [1]

    def landed_then_failed(records: list[bytes]) -> bool:
        done = append(records)
        if failures:
            failures.pop()
            raise JournalWriteError("write failed, and so did cutting it off (injected)")
        return done
    core.journal.store.append = landed_then_failed  # type: ignore[method-assign]
    (lost,) = core.put_start("w", ["lost"], [KIB], ReplicateConfig())
    assert core.put_end("w", ["lost"], [1]) == [E.OK]
    assert not core.journal.commit()
    (res,) = core.put_start("w", ["y"], [KIB], ReplicateConfig())
    assert res.replicas[0].addr != lost.replicas[0].addr
    assert core.put_end("w", ["y"], [2]) == [E.OK]
    assert live_and_replayed(core, tmp_path) == ({"y"}, {"y"})
    core2 = open_core(clock, tmp_path)
    mount(core2, 0, 21)
    assert set(core2.objects) == {"y"}
    core2.check_integrity()


def test_random_histories_replay_to_the_same_tables(tmp_path: Path) -> None:
    """Random puts, upserts, removes, evictions, segment drops and re-mounts (with
    compactions on the way); a master opened on the directory, once every segment is back,
    has exactly the objects of the original, at the same addresses."""
    import random

    for seed in range(8):
        rng = random.Random(seed)
        clock = VirtualClock()
        state_dir = tmp_path / str(seed)
        core = MasterCore(MasterConfig(seed=seed), clock)
        core.journal = Journal(PersistConfig(str(state_dir), compact_bytes=4096), core)
        fences = {i: 100 + i for i in range(3)}
        for i in range(3):
            mount(core, i, fences[i])
        for _ in range(300):
            op = rng.random()
            key = f"k{rng.randrange(60)}"
            if op < 0.55:
                size = rng.choice([200, 1000, 5000])
                (res,) = core.put_start("w", [key], [size],
                                        ReplicateConfig(replica_num=rng.choice([1, 2])),
                                        upsert=rng.random() < 0.3)
                if res.code == E.OK:
                    core.put_end("w", [key], [rng.randrange(1 << 64)])
            elif op < 0.8:
                core.remove([key], force=True)
            elif op < 0.85:
                core.evict(4096)
            elif op < 0.9:
                i = rng.randrange(3)
                sid = f"127.0.0.1:{9000 + i}/10000"
                if sid in core.segments:
                    core.unmount_segment(f"c{i}", sid)
                else:
                    fences[i] += 10
                    mount(core, i, fences[i])
            core.heartbeat("w"), core.heartbeat("c0"), core.heartbeat("c1"), core.heartbeat("c2")
            core.tick()
            core.check_integrity()
        assert core.journal is not None
        core.journal.commit()
        want = {k: (o.size, o.checksum, sorted((r.segment.segment_id, r.offset)
                                                for r in o.replicas))
                for k, o in core.objects.items()}
        core2 = open_core(clock, state_dir)
        for i in range(3):
            if f"127.0.0.1:{9000 + i}/10000" in core.segments:
                mount(core2, i, fences[i] + 1)
        got = {k: (o.size, o.checksum, sorted((r.segment.segment_id, r.offset)
                                               for r in o.replicas))
               for k, o in core2.objects.items()}
        assert got == want, seed
        core2.check_integrity()


def _journaled_core(clock: VirtualClock, state_dir: Path) -> MasterCore:
    core = MasterCore(MasterConfig(seed=7), clock)
    core.journal = Journal(PersistConfig(str(state_dir), fsync="never"), core)
    return core


def test_a_damaged_remove_record_does_not_resurrect_onto_reused_memory(tmp_path: Path) -> None:
    clock = VirtualClock()
    core = _journaled_core(clock, tmp_path)
    assert core.mount_segment("c0", "127.0.0.1:9000", 0x10000, 64 * KIB, fence=11)[0] == E.OK
    x = core.put_start("w", ["X"], [KIB])[0]
    assert core.put_end("w", ["X"], [None]) == [E.OK]
    core.journal.commit()
    assert core.remove(["X"]) == [E.OK]
    core.journal.commit()
    y = core.put_start("w", ["Y"], [KIB])[0]
    assert y.replicas[0].addr == x.replicas[0].addr          # Y reuses X's memory
    assert core.put_end("w", ["Y"], [None]) == [E.OK]
    core.journal.commit()
    core.journal.close()
    # one flipped bit in the body of the R record
    (log,) = [p for p in tmp_path.iterdir() if p.name.startswith("log.")]
    data = bytearray(log.read_bytes())
    rec = encode_record(["R", "X"])
    at = bytes(data).index(rec)
    data[at + len(rec) - 1] ^= 1
    log.write_bytes(bytes(data))
    clock.advance(1)
    core2 = _journaled_core(clock, tmp_path)
    assert core2.mount_segment("c0", "127.0.0.1:9000", 0x10000, 64 * KIB, fence=21)[0] == E.OK
    core2.check_integrity()
    gx, gy = core2.get_replicas(["X", "Y"])
    # Y was acknowledged after X's removal; whatever replay lost, it must not serve X from
    # the bytes of Y (nor drop Y in X's favour)
    assert not (gx.code == E.OK and gx.replicas[0].addr == y.replicas[0].addr), \
        f"removed X served OK from Y's memory; Y answers {gy.code.name}"
