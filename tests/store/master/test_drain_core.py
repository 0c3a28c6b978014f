"""The master side of draining a store node, on a virtual clock, with the integrity check
after every step."""

from __future__ import annotations

import random
from pathlib import Path

from kvpool.clock import VirtualClock
from kvpool.store.config import MasterConfig, ReplicateConfig
from kvpool.store.master.core import MasterCore
from kvpool.store.master.persist import Journal, PersistConfig, load_state
from kvpool.store.wire.codes import ErrorCode as E
from kvpool.store.wire.codes import ReplicaState
from kvpool.store.wire.drain import DrainStep
from tests.store.conftest import KIB, live_for, make_core

A = "127.0.0.1:9000"
B = "127.0.0.1:9001"
C = "127.0.0.1:9002"


def put(core: MasterCore, key: str, size: int = KIB, replicas: int = 1,
        preferred: tuple[str, ...] = (), upsert: bool = False) -> None:
    cfg = ReplicateConfig(replica_num=replicas, preferred_segments=preferred)
    (res,) = core.put_start("w", [key], [size], cfg, upsert)
    assert res.code == E.OK, res
    assert core.put_end("w", [key], [hash(key) & 0xFFFF]) == [E.OK]
    core.check_integrity()


def endpoints(core: MasterCore, key: str) -> list[str]:
    return sorted(r.segment.endpoint for r in core.objects[key].replicas)


def step(core: MasterCore, address: str = A, max_keys: int = 100,
         max_bytes: int = 1 << 30) -> DrainStep:
    out = core.drain.start("d", address, max_keys, max_bytes)
    core.check_integrity()
    return out


def finish(core: MasterCore, result: DrainStep, ok: bool = True) -> list[E]:
    keys = [m.key for m in result.moves]
    codes = core.drain.end("d", keys, [0 if ok else int(E.TRANSFER_FAIL)] * len(keys))
    core.check_integrity()
    return codes


def test_unknown_address_and_dry_run(vclock: VirtualClock) -> None:
    core = make_core(vclock, 3)
    put(core, "a", preferred=(A,))
    put(core, "r", replicas=2, preferred=(A, B))
    assert core.drain.begin("127.0.0.1:1").code == E.SEGMENT_NOT_FOUND
    plan = core.drain.begin(A, dry_run=True)
    assert (plan.code, plan.num_objects, plan.num_bytes, plan.num_other_replica) == \
        (E.OK, 2, 2 * KIB, 1)
    assert plan.free_bytes == 2 * 64 * KIB - KIB  # "r" has 1 KiB on B
    assert not any(s.draining for s in core.segments.values())
    assert step(core).code == E.SEGMENT_NOT_FOUND  # a dry run starts nothing


def test_drain_moves_and_keeps_replica_count(vclock: VirtualClock) -> None:
    core = make_core(vclock, 3)
    for i in range(5):
        put(core, f"k{i}", preferred=(A,))
    put(core, "r", replicas=2, preferred=(A, B))
    plan = core.drain.begin(A)
    assert plan.segment_ids == (f"{A}/10000",)
    assert [s.draining for s in core.segment_infos()] == [True, False, False]
    core.check_integrity()
    result = step(core, max_keys=4)
    assert len(result.moves) == 4 and not result.done
    for move in result.moves:
        assert move.target.state == ReplicaState.PENDING
        assert move.target.endpoint != A
        assert A in [s.endpoint for s in move.sources]
        assert core.objects[move.key].lease_until == 10.0
    assert finish(core, result) == [E.OK] * 4
    result = step(core)
    assert len(result.moves) == 2 and result.num_pending == 2 and not result.done
    assert finish(core, result) == [E.OK] * 2
    result = step(core)
    assert result.done and not result.moves and not result.unplaced
    assert core.segments[f"{A}/10000"].keys == set()
    assert all(A not in endpoints(core, k) for k in core.objects)
    assert endpoints(core, "r") == [B, C]  # a new replica on the third node, not B twice
    live_for(core, vclock, 12, ("w", "c0", "c1", "c2", "d"))  # leases end: ranges freed
    core.check_integrity()
    assert core.segments[f"{A}/10000"].allocator.used_bytes == 0


def test_placement_skips_draining_segments(vclock: VirtualClock) -> None:
    core = make_core(vclock, 2)
    core.drain.begin(A)
    for i in range(20):
        put(core, f"k{i}")
        assert endpoints(core, f"k{i}") == [B]
    (res,) = core.put_start("w", ["p"], [KIB], ReplicateConfig(preferred_segments=(A,)))
    assert [r.endpoint for r in res.replicas] == [B]
    (res,) = core.put_start("w", ["two"], [KIB], ReplicateConfig(replica_num=2))
    assert res.code == E.NO_AVAILABLE_HANDLE
    assert core.drain.cancel(A) == E.OK
    assert core.drain.cancel(A) == E.SEGMENT_NOT_FOUND
    put(core, "after", preferred=(A,))
    assert endpoints(core, "after") == [A]


def test_no_room_leaves_objects_in_place(vclock: VirtualClock) -> None:
    core = make_core(vclock, 2, capacity=8 * KIB)
    for i in range(3):
        put(core, f"a{i}", 2 * KIB, preferred=(A,))
    put(core, "b", 6 * KIB, preferred=(B,))
    put(core, "r", KIB, replicas=2)
    core.drain.begin(A)
    result = step(core)
    assert sorted(u.key for u in result.unplaced) == ["a0", "a1", "a2"]  # 1 KiB free on B
    assert {u.code for u in result.unplaced} == {E.NO_AVAILABLE_HANDLE}
    assert result.num_dropped == 1 and result.dropped_bytes == KIB  # "r" keeps B's copy
    assert result.done and not result.moves
    assert endpoints(core, "r") == [B]
    assert step(core).unplaced == ()  # not offered again in this drain
    assert core.drain.cancel(A) == E.OK
    assert sorted(core.segments[f"{A}/10000"].keys) == ["a0", "a1", "a2"]
    core.check_integrity()


def test_upsert_and_remove_during_a_move_discard_it(vclock: VirtualClock) -> None:
    core = make_core(vclock, 2)
    put(core, "u", preferred=(A,))
    put(core, "x", preferred=(A,))
    put(core, "stay", preferred=(A,))
    core.drain.begin(A)
    result = step(core)
    assert len(result.moves) == 3
    put(core, "u", 2 * KIB, upsert=True)  # lands on B: placement skips A
    assert core.remove(["x"], force=True) == [E.OK]
    core.check_integrity()
    codes = dict(zip([m.key for m in result.moves], finish(core, result), strict=True))
    assert codes == {"u": E.OBJECT_NOT_FOUND, "x": E.OBJECT_NOT_FOUND, "stay": E.OK}
    assert core.objects["u"].size == 2 * KIB and endpoints(core, "u") == [B]
    assert "x" not in core.objects
    assert step(core).done


def test_failed_copy_gives_the_range_back(vclock: VirtualClock) -> None:
    core = make_core(vclock, 2)
    put(core, "k", preferred=(A,))
    core.drain.begin(A)
    used = core.segments[f"{B}/10000"].allocator.used_bytes
    result = step(core)
    assert finish(core, result, ok=False) == [E.OK]
    assert core.segments[f"{B}/10000"].allocator.used_bytes == used
    assert endpoints(core, "k") == [A]
    assert core.drain.end("d", ["k"], [0]) == [E.LEASE_EXPIRED]  # no such move any more
    assert step(core).done  # not offered again in this drain: it stays where it is
    core.drain.begin(A)  # beginning again retries it
    result = step(core)
    assert [m.key for m in result.moves] == ["k"]
    assert core.drain.end("someone-else", ["k"], [0]) == [E.LEASE_EXPIRED]
    assert finish(core, result) == [E.OK]
    assert endpoints(core, "k") == [B]


def test_abandoned_moves_are_discarded_and_released_late(vclock: VirtualClock) -> None:
    core = make_core(vclock, 2, put_discard_timeout_s=5, put_release_timeout_s=20)
    put(core, "k", preferred=(A,))
    core.drain.begin(A)
    result = step(core)
    seg_b = core.segments[f"{B}/10000"]
    live_for(core, vclock, 7.5, ("w", "c0", "c1"))
    assert core.drain.moves == {}
    assert seg_b.allocator.used_bytes == KIB  # a late writer may still copy there
    assert finish(core, result) == [E.LEASE_EXPIRED]
    live_for(core, vclock, 20, ("w", "c0", "c1"))
    assert seg_b.allocator.used_bytes == 0
    assert endpoints(core, "k") == [A]


def test_target_or_source_node_dying_mid_move(vclock: VirtualClock) -> None:
    core = make_core(vclock, 3)
    put(core, "k", preferred=(A,))
    put(core, "r", replicas=2, preferred=(A, B))
    core.drain.begin(A)
    result = step(core)
    targets = {m.key: m.target.endpoint for m in result.moves}
    assert targets["r"] == C
    # the target of "r" leaves: that move is void; the drained node leaves: "k" is gone
    core.unmount_segment("c2", f"{C}/10000")
    core.check_integrity()
    core.unmount_segment("c0", f"{A}/10000")
    core.check_integrity()
    assert core.drain.drains == {}
    codes = dict(zip([m.key for m in result.moves], finish(core, result), strict=True))
    assert codes == {"k": E.OBJECT_NOT_FOUND if targets["k"] == B else E.LEASE_EXPIRED,
                     "r": E.LEASE_EXPIRED}
    assert "k" not in core.objects and endpoints(core, "r") == [B]
    assert step(core).code == E.SEGMENT_NOT_FOUND


def test_pending_put_on_drained_segment_is_waited_for(vclock: VirtualClock) -> None:
    core = make_core(vclock, 2)
    (res,) = core.put_start("w", ["late"], [KIB], ReplicateConfig(preferred_segments=(A,)))
    assert res.replicas[0].endpoint == A
    plan = core.drain.begin(A)
    assert plan.num_pending == 1
    result = step(core)
    assert not result.done and result.num_pending == 1 and not result.moves
    assert core.put_end("w", ["late"]) == [E.OK]
    result = step(core)
    assert [m.key for m in result.moves] == ["late"]
    finish(core, result)
    assert step(core).done and endpoints(core, "late") == [B]


def test_max_bytes_bounds_a_batch(vclock: VirtualClock) -> None:
    core = make_core(vclock, 2)
    for i in range(6):
        put(core, f"k{i}", 4 * KIB, preferred=(A,))
    core.drain.begin(A)
    sizes = []
    while not (result := step(core, max_bytes=10 * KIB)).done:
        sizes.append(len(result.moves))
        finish(core, result)
    assert sizes == [3, 3, 0] or sizes == [3, 3]
    assert all(endpoints(core, f"k{i}") == [B] for i in range(6))


def test_moves_are_journaled(vclock: VirtualClock, tmp_path: Path) -> None:
    core = MasterCore(MasterConfig(seed=7), vclock)
    core.journal = Journal(PersistConfig(str(tmp_path)), core)
    for i in range(3):
        assert core.mount_segment(f"c{i}", f"127.0.0.1:{9000 + i}", 0x10000, 64 * KIB,
                                  fence=i + 1)[0] == E.OK
    put(core, "k", preferred=(A,))
    put(core, "r", replicas=2, preferred=(A, B))
    core.drain.begin(A)
    finish(core, step(core))
    core.journal.commit()
    core.journal.close()
    state, _ = load_state(tmp_path)
    assert {k: sorted(s for s, _ in o.replicas) for k, o in state.objects.items()} == {
        k: sorted(r.segment.segment_id for r in o.replicas) for k, o in core.objects.items()}
    assert all(f"{A}/10000" not in [s for s, _ in o.replicas] for o in state.objects.values())
    assert state.objects["k"].checksum == hash("k") & 0xFFFF


def test_random_interleavings_keep_integrity(vclock: VirtualClock) -> None:
    """Puts, upserts, removes, drain steps and ends (good and failed), cancels, ticks and a
    node leaving, in random order: the integrity check holds after every step, and every
    object that was never removed keeps at least one replica."""
    rng = random.Random(11)
    core = make_core(vclock, 3, capacity=32 * KIB, put_discard_timeout_s=3,
                     put_release_timeout_s=5)
    open_moves: list[str] = []
    for _ in range(3000):
        op = rng.randrange(9)
        key = f"k{rng.randrange(40)}"
        if op <= 1:
            cfg = ReplicateConfig(replica_num=rng.choice((1, 2)))
            (res,) = core.put_start("w", [key], [rng.randrange(1, 3 * KIB)], cfg, op == 1)
            if res.code == E.OK:
                core.put_end("w", [key], [1])
        elif op == 2:
            core.remove([key], force=True)
        elif op == 3:
            core.drain.begin(rng.choice((A, B, C)))
        elif op == 4:
            result = core.drain.start("d", rng.choice((A, B, C)), 5, 8 * KIB)
            open_moves += [m.key for m in result.moves]
        elif op == 5 and open_moves:
            done = open_moves.pop(rng.randrange(len(open_moves)))
            core.drain.end("d", [done], [rng.choice((0, 0, int(E.TRANSFER_FAIL)))])
        elif op == 6:
            core.drain.cancel(rng.choice((A, B, C)))
        elif op == 7:
            live_for(core, vclock, rng.choice((0.5, 2.0)), ("w", "c0", "c1", "c2", "d"))
        elif op == 8 and rng.random() < 0.02:
            i = rng.randrange(3)
            core.unmount_segment(f"c{i}", f"127.0.0.1:{9000 + i}/10000")
            core.mount_segment(f"c{i}", f"127.0.0.1:{9000 + i}", 0x10000, 32 * KIB)
        core.check_integrity()


def _silent_until_dropped(core: MasterCore, clock: VirtualClock, client: str,
                          others: tuple[str, ...]) -> None:
    """`client` stops heartbeating until the master drops it; then it mounts the same memory
    again under fence 0 (a node without fences)."""
    live_for(core, clock, core.config.client_ttl_s + 3, clients=others)
    assert not any(s.client_id == client for s in core.segments.values())
    assert core.heartbeat(client) != E.OK
    code, _ = core.mount_segment(client, "127.0.0.1:9000", 0x10000, 64 * KIB, fence=0)
    assert code == E.OK


def test_a_move_target_on_a_dropped_segment_is_not_handed_out_while_written(
        vclock: VirtualClock) -> None:
    """A move's writer may still be copying into its target when the target's node is
    dropped; if the same memory comes back under the same fence, that range is not given
    to a new put until the writer's time is up."""
    core = make_core(vclock)
    c1 = "127.0.0.1:9001/10000"
    (res,) = core.put_start("w", ["obj"], [KIB], ReplicateConfig(preferred_segment=c1))
    assert core.put_end("w", ["obj"], [1]) == [E.OK]
    core.drain.begin("127.0.0.1:9001")
    step = core.drain.start("d", "127.0.0.1:9001", 16, 1 << 20)
    target = step.moves[0].target
    _silent_until_dropped(core, vclock, "c0", ("w", "d", "c1"))
    (new,) = core.put_start("w", ["new"], [KIB], ReplicateConfig(
        preferred_segment=target.segment_id))
    assert new.code == E.OK and new.replicas[0].addr != target.addr
    core.check_integrity()



def test_a_put_with_no_room_evicts_where_it_can_be_placed_not_on_the_drained_node(
        vclock: VirtualClock) -> None:
    """The least recently used objects are on a draining node, where no put is placed:
    evicting them would free nothing the put can use (it would fail, and they would be
    gone). The put evicts on the segments that take it instead."""
    core = MasterCore(MasterConfig(seed=1, high_watermark=0.99), vclock)
    for i in range(2):
        assert core.mount_segment(f"c{i}", f"127.0.0.1:{9000 + i}", 0x100000,
                                  640 * KIB)[0] == E.OK
    drained, kept = "127.0.0.1:9000/100000", "127.0.0.1:9001/100000"
    for prefix, segment, n in (("a", drained, 9), ("b", kept, 10)):
        for i in range(n):
            core.put_start("w", [f"{prefix}{i}"], [64 * KIB],
                           ReplicateConfig(preferred_segment=segment))
            assert core.put_end("w", [f"{prefix}{i}"], [i]) == [E.OK]
        vclock.advance(1)
    vclock.advance(20)                                   # no lease left
    core.drain.begin("127.0.0.1:9000")
    for n in range(3):
        assert core.put_start("w", [f"new{n}"], [64 * KIB])[0].code == E.OK
    assert len(core.segments[drained].keys) == 9         # still there, to be moved
    core.check_integrity()
