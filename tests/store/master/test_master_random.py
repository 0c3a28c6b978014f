"""Randomized operation sequences on the master core: the integrity check holds after every
operation, and visible objects match a simple model."""

from __future__ import annotations

import random

import pytest

from kvpool.clock import VirtualClock
from kvpool.store.config import ReplicateConfig
from kvpool.store.wire.codes import ErrorCode as E
from tests.store.conftest import KIB, live_for, make_core


@pytest.mark.parametrize("seed", range(6))
def test_random_operations_match_model(seed: int) -> None:
    rng = random.Random(seed)
    clock = VirtualClock()
    core = make_core(clock, num_segments=3, capacity=4096 * KIB)
    model: dict[str, int] = {}           # complete objects: key -> size
    pending: dict[str, tuple[int, float]] = {}   # key -> (size, started)
    leased_until: dict[str, float] = {}
    for _ in range(1500):
        key = f"k{rng.randrange(60)}"
        op = rng.random()
        if op < 0.3:
            size = rng.randint(1, 20 * KIB)
            cfg = ReplicateConfig(replica_num=rng.randint(1, 3))
            (res,) = core.put_start("w", [key], [size], cfg, upsert=rng.random() < 0.2)
            if key in pending or (key in model and res.code == E.OBJECT_ALREADY_EXISTS):
                assert res.code == E.OBJECT_ALREADY_EXISTS
            else:
                assert res.code == E.OK and len(res.replicas) == cfg.replica_num
                pending[key] = (size, clock.now())
        elif op < 0.5 and pending:
            done = rng.choice(sorted(pending))
            if rng.random() < 0.8:
                assert core.put_end("w", [done]) == [E.OK]
                model[done] = pending.pop(done)[0]
                leased_until.pop(done, None)     # an upserted object starts without a lease
            else:
                assert core.put_revoke("w", [done]) == [E.OK]
                del pending[done]
        elif op < 0.75:
            (look,) = core.get_replicas([key])
            if key in model:
                assert look.code == E.OK and look.size == model[key]
                leased_until[key] = clock.now() + 10.0
            else:
                assert look.code == E.OBJECT_NOT_FOUND
        elif op < 0.9:
            force = rng.random() < 0.3
            (code,) = core.remove([key], force)
            if key not in model:
                assert code == E.OBJECT_NOT_FOUND
            elif leased_until.get(key, 0) > clock.now() and not force:
                assert code == E.OBJECT_HAS_LEASE
            else:
                assert code == E.OK
                del model[key]
        else:
            live_for(core, clock, rng.choice([0.5, 3.0, 11.0]), ("w", "c0", "c1", "c2"))
            pending = {k: v for k, v in pending.items() if v[1] >= clock.now() - 30.0}
        core.check_integrity()
        assert set(core.objects) == set(model)
        assert set(core.pending) == set(pending)
    core.remove_all(force=True)
    for key in list(pending):
        core.put_revoke("w", [key])
    live_for(core, clock, 601, ("c0", "c1", "c2"))  # leases, release timeout of discarded puts
    core.check_integrity()
    assert core.used_bytes == 0


@pytest.mark.parametrize("seed", range(4))
def test_random_failures_keep_integrity(seed: int) -> None:
    rng = random.Random(100 + seed)
    clock = VirtualClock()
    core = make_core(clock, num_segments=4, capacity=256 * KIB, high_watermark=0.7)
    for step in range(1200):
        key = f"k{rng.randrange(200)}"
        op = rng.random()
        client = f"w{rng.randrange(3)}"
        if op < 0.45:
            (res,) = core.put_start(client, [key], [rng.randint(1, 40 * KIB)],
                                    ReplicateConfig(replica_num=rng.randint(1, 2),
                                                    with_soft_pin=rng.random() < 0.1))
            if res.code == E.OK and rng.random() < 0.85:
                core.put_end(client, [key])
        elif op < 0.7:
            core.get_replicas([key])
        elif op < 0.8:
            core.remove([key], force=rng.random() < 0.5)
        elif op < 0.85:
            victim = rng.choice(sorted(core.segments)) if core.segments else None
            if victim is not None:
                core.unmount_segment(core.segments[victim].client_id, victim)
        elif op < 0.9:
            i = rng.randrange(4)
            core.mount_segment(f"c{i}", f"127.0.0.1:{9000 + i}", 0x10000 * (step + 1),
                               256 * KIB)
        else:
            clock.advance(rng.choice([0.5, 4.0, 31.0]))
            for alive in ("c0", "c1", "w0", "w1"):
                core.heartbeat(alive)
            core.tick()
        core.check_integrity()
        if core.capacity_bytes:
            assert core.used_bytes <= core.capacity_bytes
