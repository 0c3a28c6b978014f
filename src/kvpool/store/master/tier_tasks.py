"""Tasks the master hands a store node's disk tier, and the per-node queue that holds them.

The master never calls a node: a node with a disk tier asks for its tasks (NODE_TASKS) and
reports outcomes (NODE_REPORT). A task handed out and not reported within `redeliver_s` is
handed out again; a node reports `[task_id, status]` (DONE, FAILED, FILE_BAD). Every task is idempotent on the node (rewrite the same file, copy the same
bytes into the same range, delete a file of a given generation), so a lost reply costs time,
never correctness. On the wire a task is

    [task_id, kind, key, endpoint, addr, size, checksum, gen, fence]

`endpoint`/`addr`/`fence` name the DRAM range (the offload's source, the load's target),
`checksum` is the object's xxh3_64 (nil: none recorded) and `gen` the file generation.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from kvpool.store.master.state import Replica, Segment, StoredObject
from kvpool.store.wire.messages import NodeTask

OFFLOAD = 1
"""Copy the DRAM range into a file of generation `gen`."""
LOAD = 2
"""Copy the file of generation `gen`, verified, into the DRAM range."""
DELETE = 3
"""Delete the key's file if it is of generation `gen`."""

DONE = 0
FAILED = 1
"""The task could not be done (I/O or transfer error, a fence): nothing is known bad."""
FILE_BAD = 2
"""A load found the file missing, torn or corrupt (the node deleted it)."""


@dataclass(frozen=True)
class TierConfig:
    disk_high_watermark: float = 0.95
    """Disk eviction starts above this share of a disk tier's capacity..."""
    disk_low_watermark: float = 0.85
    """...and frees down to this share."""
    redeliver_s: float = 10.0
    """A task handed out and not reported for this long is handed out again."""
    max_tasks_per_poll: int = 256
    max_task_bytes_per_poll: int = 32 << 20
    """One poll hands out at most this many object bytes (at least one task), so a node
    reports (and frees DRAM) every few tens of MiB."""
    transient_lease_s: float = 0.25
    """Read lease of a lookup that finds a transient (loaded, not promoted) copy, or a load
    under way; the copy is freed when it ends. It bounds how fast disk-only data can be
    read: at most DRAM capacity per lease."""
    clean_share: float = 0.2
    """Share of DRAM capacity, at the cold end of the eviction order, kept on disk as well
    ("clean"): eviction then frees DRAM at once instead of waiting for an offload. 0: copy
    only when evicting."""
    max_cleaning: int = 1024
    """At most this many copy-ahead offloads in flight per disk."""
    clean_interval_s: float = 0.005
    """The copy-ahead walk runs at most this often outside ticks (it walks the clean
    share of the eviction order)."""


@dataclass(eq=False, slots=True)
class Task:
    task_id: int
    kind: int
    key: str
    obj: StoredObject | None
    """The object the task serves; None once it was removed or replaced (cancelled)."""
    size: int
    checksum: int | None
    gen: int
    dram: Replica | None = None
    """DRAM range: the offload's source, or the load's target (held by the task)."""
    ssd: Replica | None = None
    """Disk range: the offload's destination (held by the task), or the load's source."""
    sent_at: float | None = None
    evict: bool = True
    """An offload that frees the object's DRAM when done (eviction), or False: a copy
    ahead of eviction that leaves DRAM as it is (the object becomes clean)."""

    def wire(self) -> NodeTask:
        seg = self.dram.segment if self.dram is not None else None
        return NodeTask(self.task_id, self.kind, self.key, seg.endpoint if seg else "",
                        seg.base_addr + self.dram.offset if seg and self.dram else 0,
                        self.size, self.checksum, self.gen, seg.fence if seg else 0)


@dataclass(eq=False)
class SsdMount:
    """One node's disk tier: its SSD segment (the master's account of the disk) and the
    queue of tasks for it, of which it is the only writer."""

    segment: Segment
    promote_after: int
    tasks: OrderedDict[int, Task] = field(default_factory=OrderedDict)

    def set_promote_after(self, promote_after: int) -> None:
        self.promote_after = promote_after

    def add(self, task: Task) -> None:
        """Queue `task` (a new id) for the node."""
        self.tasks[task.task_id] = task

    def take(self, task_id: int) -> Task | None:
        """The task `task_id`, now out of the queue; None if not queued (reported twice,
        or cancelled)."""
        return self.tasks.pop(task_id, None)

    def due(self, now: float, redeliver_s: float, limit: int,
            limit_bytes: int = 1 << 62) -> list[Task]:
        """Tasks never handed out, or handed out longer than `redeliver_s` ago, loads first
        (a reader waits for them), at most `limit` of them and about `limit_bytes` of
        objects; marks them handed out now."""
        out: list[Task] = []
        budget = [limit, limit_bytes]
        for loads in (True, False):
            for task in self.tasks.values():
                if budget[0] <= 0 or budget[1] <= 0:
                    return out
                if (task.kind == LOAD) == loads and \
                        (task.sent_at is None or now - task.sent_at >= redeliver_s):
                    task.sent_at = now
                    out.append(task)
                    budget[0] -= 1
                    budget[1] -= task.size
        return out

    def check_integrity(self) -> None:
        """AssertionError unless every task is queued under its id."""
        for task_id, task in self.tasks.items():
            assert task.task_id == task_id, f"task {task.task_id} queued as {task_id}"


@dataclass
class TierStats:
    offloads: int = 0
    offload_failures: int = 0
    loads: int = 0
    load_failures: int = 0
    promotions: int = 0
    copied_ahead: int = 0
    """Offloads done ahead of eviction (the object stayed in DRAM, now clean)."""
    dram_dropped: int = 0
    """DRAM copies of objects already on disk freed by eviction (no copy needed)."""
    disk_evicted_objects: int = 0
    disk_evicted_bytes: int = 0
    registered: int = 0
    register_refused: int = 0
