"""The disk tier's two tables (tier_state.py holds one of each): which keys are on disk and
what the read side knows of them (`DiskKeys`), and the offloads and loads under way with
the copy-ahead walk's schedule (`TierTransfers`).

Rule: each class here is the only writer of its fields. Their fields are public to be read
(the lookup probes `DiskKeys.tiered` once per key); everything else asks and acts through
their methods, and `check_integrity` asserts what those methods keep true. A test walks
every module of the master and fails on a write of a table's field outside its module.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from kvpool.store.master.state import StoredObject
from kvpool.store.master.tier_tasks import Task


class DiskKeys:
    """Keys with a disk replica, the file generation of each replica, their disk LRU order,
    and the state of their DRAM copies; also the keys whose offload failed."""

    def __init__(self) -> None:
        self.tiered: set[str] = set()
        """Keys with a disk replica (the lookup's one-set-probe test)."""
        self.gens: dict[tuple[str, str], int] = {}
        """(SSD segment id, key) -> generation of the file that holds the replica."""
        self.lru: OrderedDict[str, None] = OrderedDict()
        """The tiered keys, least recently used first (disk eviction's order)."""
        self.reads: dict[str, int] = {}
        """Reads of an object since it went to disk (reset by promotion)."""
        self.transient: set[str] = set()
        """Keys whose DRAM copy is a load not promoted (freed when its lease ends)."""
        self.fresh: set[str] = set()
        """Transient copies not looked up since their load completed."""
        self.failed: set[str] = set()
        """Keys whose offload failed: the next eviction drops them."""

    # -- disk replicas ---------------------------------------------------------------------

    def add(self, key: str, segment_id: str, gen: int) -> None:
        """`key` has a disk replica on `segment_id` in a file of generation `gen`; it
        becomes the most recently used and its read count starts over."""
        self.gens[(segment_id, key)] = gen
        self.tiered.add(key)
        self.lru[key] = None
        self.lru.move_to_end(key)
        self.reads.pop(key, None)

    def forget_replica(self, key: str, segment_id: str) -> int | None:
        """Forget the file of `key` on `segment_id`; its generation, if one was known."""
        return self.gens.pop((segment_id, key), None)

    def forget_segment(self, segment_id: str) -> dict[str, int]:
        """Forget every file generation on `segment_id` (the segment is gone); key ->
        generation of the files forgotten."""
        gone = [gk for gk in self.gens if gk[0] == segment_id]
        return {key: self.gens.pop((sid, key)) for sid, key in gone}

    def untier(self, key: str) -> None:
        """`key` has no disk replica left: a plain DRAM object again (a transient copy
        becomes a normal replica)."""
        self.tiered.discard(key)
        self.transient.discard(key)
        self.fresh.discard(key)
        self.lru.pop(key, None)
        self.reads.pop(key, None)

    def removed(self, key: str) -> None:
        """`key`'s object is gone: forget everything but the generations (forget_replica)."""
        self.untier(key)
        self.failed.discard(key)

    # -- reads -----------------------------------------------------------------------------

    def touch(self, key: str) -> None:
        """`key` was looked up: the most recently used."""
        self.lru.move_to_end(key)

    def count_read(self, key: str) -> int:
        """Count one read of `key`; the reads since it went to disk."""
        reads = self.reads[key] = self.reads.get(key, 0) + 1
        return reads

    def seen_fresh(self, key: str) -> bool:
        """Whether `key`'s copy was loaded and not looked up since (it is not any more)."""
        if key in self.fresh:
            self.fresh.discard(key)
            return True
        return False

    def loaded(self, key: str, transient: bool) -> None:
        """A load of `key` completed: its copy is fresh, and `transient` unless promoted."""
        self.fresh.add(key)
        if transient:
            self.transient.add(key)

    def promoted(self, key: str) -> None:
        """`key`'s DRAM copy is a normal replica again: no longer transient."""
        self.transient.discard(key)
        self.reads.pop(key, None)

    def dram_dropped(self, key: str) -> None:
        """`key` lost its DRAM copy (it stays on disk)."""
        self.transient.discard(key)
        self.fresh.discard(key)

    # -- failed offloads ---------------------------------------------------------------------

    def offload_failed(self, key: str) -> None:
        self.failed.add(key)

    def take_failed(self, key: str) -> bool:
        """Whether `key`'s last offload failed (it is forgotten: eviction drops it now)."""
        if key in self.failed:
            self.failed.discard(key)
            return True
        return False

    def check_integrity(self, disk_replicas: Callable[[str], int]) -> None:
        """AssertionError unless every tiered key has a disk replica (`disk_replicas(key)`
        counts them) and is in the LRU order, and transient, fresh and counted keys are
        tiered."""
        for key in self.tiered:
            assert disk_replicas(key) > 0, f"tiered {key!r} has no disk replica"
        assert self.lru.keys() == self.tiered, "the disk LRU order is not the tiered keys"
        for key in self.transient | self.fresh | self.reads.keys():
            assert key in self.tiered, f"transient or read {key!r} is not on disk"


class TierTransfers:
    """Offloads under way (evictions, and copies ahead of eviction), loads under way, and
    when the copy-ahead walk runs next."""

    def __init__(self) -> None:
        self.offloading: dict[str, Task] = {}
        """Offloads under way: evictions and copies ahead of eviction (Task.evict)."""
        self.offloading_bytes = 0
        """Bytes of the evicting offloads under way (they free DRAM when done)."""
        self.num_cleaning = 0
        """Copies ahead of eviction under way."""
        self.loading: dict[str, Task] = {}
        """Loads under way, by key."""
        self.clean_due = 0.0
        """Clock time before which the copy-ahead walk is not run again (outside ticks)."""
        self.clean_wanted = True
        """Eviction took from the clean share, or the last walk stopped at the in-flight
        cap: walk again after the next eviction round or report (ticks always walk)."""

    # -- offloads ----------------------------------------------------------------------------

    def evicting(self, key: str) -> bool:
        """Whether an offload under way frees `key`'s DRAM when done."""
        task = self.offloading.get(key)
        return task is not None and task.evict

    def start_offload(self, task: Task, evict: bool) -> None:
        """`task` (an OFFLOAD of a key with none under way) is under way: an eviction, or
        a copy ahead of eviction (`evict` False)."""
        assert task.key not in self.offloading, f"{task.key!r} offloaded twice"
        task.evict = evict
        self.offloading[task.key] = task
        if evict:
            self.offloading_bytes += task.size
        else:
            self.num_cleaning += 1

    def evict_when_copied(self, task: Task) -> None:
        """A copy ahead under way frees its DRAM when it lands: its bytes now count as
        being offloaded."""
        if not task.evict:
            task.evict = True
            self.num_cleaning -= 1
            self.offloading_bytes += task.size

    def untrack_offload(self, task: Task) -> None:
        """Forget `task` as an offload under way (if it still is)."""
        if self.offloading.get(task.key) is task:
            del self.offloading[task.key]
            if task.evict:
                self.offloading_bytes -= task.size
            else:
                self.num_cleaning -= 1

    # -- loads -------------------------------------------------------------------------------

    def start_load(self, task: Task) -> None:
        self.loading[task.key] = task

    def end_load(self, task: Task) -> None:
        """Forget `task` as the load under way of its key (if it still is)."""
        if self.loading.get(task.key) is task:
            del self.loading[task.key]

    def drop_load(self, key: str) -> Task | None:
        """Forget the load under way of `key`; it, or None."""
        return self.loading.pop(key, None)

    # -- the copy-ahead walk ---------------------------------------------------------------

    def want_walk(self) -> None:
        """Eviction took from the clean share: walk again at the next chance."""
        self.clean_wanted = True

    def plan_walk(self, due: float, wanted: bool) -> None:
        """The walk ran (or starts): not again before `due` outside ticks, and then only
        when `wanted` (or eviction wants it)."""
        self.clean_due, self.clean_wanted = due, wanted

    def check_integrity(self, current: Callable[[str], StoredObject | None]) -> None:
        """AssertionError unless each task is filed under its key, each offload's object is
        `current(key)`, and the counters add up."""
        for key, task in self.offloading.items():
            assert task.key == key and task.obj is current(key), \
                f"offload of {key!r} lost its object"
        for key, task in self.loading.items():
            assert task.key == key, f"load of {task.key!r} filed under {key!r}"
        assert self.offloading_bytes == sum(t.size for t in self.offloading.values()
                                            if t.evict)
        assert self.num_cleaning == sum(not t.evict for t in self.offloading.values())
