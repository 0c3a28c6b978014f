"""Random operation sequences on a master with a disk tier, on a virtual clock: puts that
evict to disk, reads that load and promote, removals, node reports that succeed, fail or
find a file bad, lost reports, ticks, a DRAM segment unmounted and mounted again, files
registered; the whole integrity check (every tier table included) after each step."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from kvpool.clock import VirtualClock
from kvpool.store.master.core import MasterCore
from kvpool.store.master.tier_tasks import DONE, FAILED, FILE_BAD
from kvpool.store.wire.codes import ErrorCode as E
from tests.store.conftest import KIB, make_core

DISK = "127.0.0.1:9000"
DRAM = 32 * KIB
"""Per segment, two segments: the 50 keys of about 4 KiB do not fit."""


def _core(clock: VirtualClock, clean_share: float,
          disk: int = 96 * KIB) -> tuple[MasterCore, str]:
    core = make_core(clock, num_segments=2, capacity=DRAM, lease_ttl_s=1.0)
    core.tiering.config = replace(core.tiering.config, clean_share=clean_share,
                                  redeliver_s=2.0)
    code, ssd_id = core.tiering.attach("c0", DISK, disk, 2)
    assert code == E.OK
    return core, ssd_id


def _put(core: MasterCore, rng: random.Random, key: str) -> None:
    size = rng.choice([4 * KIB, 4 * KIB, rng.randint(1, 8 * KIB)])
    if core.put_start("w", [key], [size])[0].code == E.OK:
        core.put_end("w", [key], [rng.getrandbits(32)])


def _node(core: MasterCore, rng: random.Random, ssd_id: str) -> None:
    """The node polls and reports most of its tasks: mostly done, some failed or bad."""
    code, due = core.tiering.next_tasks("c0", ssd_id)
    if code != E.OK:
        return
    outcomes = [(t.task_id, rng.choices([DONE, FAILED, FILE_BAD], [8, 1, 1])[0])
                for t in due if rng.random() < 0.9]
    assert core.tiering.report("c0", ssd_id, outcomes) == E.OK


def _time(core: MasterCore, clock: VirtualClock, rng: random.Random) -> None:
    clock.advance(rng.uniform(0.0, 1.5))
    for client in ("w", "c0", "c1"):
        core.heartbeat(client)
    core.tick()


def _remount(core: MasterCore) -> None:
    """Client c1 unmounts its DRAM segment (its objects go) and mounts a new one."""
    for sid in [s for s, seg in core.segments.items() if seg.client_id == "c1"]:
        assert core.unmount_segment("c1", sid) == E.OK
    assert core.mount_segment("c1", "127.0.0.1:9001", 0x10000, DRAM)[0] == E.OK


def _register(core: MasterCore, rng: random.Random, ssd_id: str) -> None:
    keys = [f"k{rng.randrange(50)}" for _ in range(3)]
    core.tiering.register("c0", ssd_id, keys, [4 * KIB] * 3,
                          [rng.getrandbits(32) for _ in keys], [rng.getrandbits(64) for _ in keys])


@pytest.mark.parametrize("seed", range(4))
def test_random_operations_keep_every_tier_table_whole(seed: int) -> None:
    rng = random.Random(seed)
    clock = VirtualClock()
    core, ssd_id = _core(clock, clean_share=0.2 if seed % 2 else 0.0,
                         disk=(48 if seed >= 2 else 96) * KIB)
    for _ in range(1200):
        key = f"k{rng.randrange(50)}"
        op = rng.random()
        if op < 0.35:
            _put(core, rng, key)
        elif op < 0.6:
            core.get_replicas([key])
        elif op < 0.66:
            core.remove([key], rng.random() < 0.5)
        elif op < 0.88:
            _node(core, rng, ssd_id)
        elif op < 0.97:
            _time(core, clock, rng)
        elif op < 0.985:
            _remount(core)
        else:
            _register(core, rng, ssd_id)
        core.check_integrity()
    stats = core.tiering.stats
    assert stats.offloads > 0 and stats.loads > 0 and stats.promotions > 0
    assert stats.offload_failures > 0 and stats.load_failures > 0
    assert stats.disk_evicted_objects > 0 or seed < 2


def test_the_check_finds_a_table_broken_on_purpose(vclock: VirtualClock) -> None:
    core, _ = _core(vclock, clean_share=0.0)
    core.check_integrity()
    core.tiering.on_disk.transient.add("nowhere")   # a copy of a key not on disk
    with pytest.raises(AssertionError, match="'nowhere' is not on disk"):
        core.check_integrity()
    core.tiering.on_disk.transient.discard("nowhere")
    core.tiering.under_way.offloading_bytes += 1    # counters that do not add up
    with pytest.raises(AssertionError):
        core.check_integrity()
