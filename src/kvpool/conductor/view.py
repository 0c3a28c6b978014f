"""The cluster as the conductor sees it: per-instance load and a block -> holders index.

The owner (simulator or live proxy) keeps this view current: it reports cached and evicted
blocks to `PrefixIndex`, and tells `ClusterView` when a request is accepted, starts decoding or
finishes. The conductor only reads it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvpool.conductor.types import Accepted, RequestInfo
from kvpool.errors import InvalidArgument

_EMPTY: frozenset[int] = frozenset()
JOIN_WINDOW_S = 60.0
"""Window over which a decode instance's join rate is measured."""


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    lens: dict[int, int]
    """instance id -> leading blocks of the request it holds (absent = 0)."""
    best_blocks: int
    """The longest prefix an instance holds that another instance can fetch from it."""
    best_instance: int | None
    """Who holds it; None when instances cannot fetch from one another (the prefix is only
    reused where it is held)."""
    pool_blocks: int = 0
    """Leading blocks a shared KV pool holds, which every instance's engine loads by itself
    (vLLM's store connector): they reach every instance at the transfer cost. 0 where the
    owner tracks no such pool (the simulator; kvpool's workers report the pool's reach as
    their own blocks)."""

    def blocks_on(self, instance_id: int) -> int:
        return self.lens.get(instance_id, 0)


class PrefixLookup(Protocol):
    """Where the conductor learns which prefill instance holds which leading blocks of a
    request: `PrefixIndex` (the view's own), or an owner's lookup over another index (the live
    proxy's, over engines' KV events)."""

    def match(self, block_hashes: Sequence[int]) -> PrefixMatch: ...


class PrefixIndex:
    """block hash -> the instances whose cache holds that block.

    Each block's holders are one int, bit i for instance i (instance ids are small: the
    index of the instance in its view). A set per block made the index tens of thousands
    of containers for Python's garbage collector to walk, and a match one new set per block;
    a dict of ints is left out of the collector's way, and a match is a bitwise `and` per
    block."""

    def __init__(self) -> None:
        self._holders: dict[int, int] = {}

    def add(self, instance_id: int, block_hash: int) -> None:
        if instance_id < 0:
            raise InvalidArgument(f"instance id {instance_id} is negative")
        holders = self._holders
        holders[block_hash] = holders.get(block_hash, 0) | (1 << instance_id)

    def remove(self, instance_id: int, block_hash: int) -> None:
        holders = self._holders.get(block_hash, 0)
        bit = 1 << instance_id if instance_id >= 0 else 0
        if not holders & bit:
            raise InvalidArgument(f"instance {instance_id} does not hold block {block_hash}")
        holders &= ~bit
        if holders:
            self._holders[block_hash] = holders
        else:
            del self._holders[block_hash]

    def holders(self, block_hash: int) -> frozenset[int]:
        mask = self._holders.get(block_hash)
        return _EMPTY if mask is None else frozenset(_instances(mask))

    def __len__(self) -> int:
        return len(self._holders)

    def match(self, block_hashes: Sequence[int]) -> PrefixMatch:
        """Leading run of `block_hashes` held by each instance; a bitwise `and` per matched
        block."""
        holders = self._holders
        lens: dict[int, int] = {}
        alive = 0
        depth = 0
        for depth, block in enumerate(block_hashes):
            mask = holders.get(block)
            if mask is None:
                break
            nxt = mask if depth == 0 else alive & mask
            gone = alive & ~nxt
            if gone:
                for inst in _instances(gone):
                    lens[inst] = depth
            alive = nxt
            if not alive:
                break
        else:
            depth = len(block_hashes)
        for inst in _instances(alive):
            lens[inst] = depth
        if not lens:
            return PrefixMatch(lens, 0, None)
        best = max(lens.values())
        best_inst = min(i for i, n in lens.items() if n == best)
        return PrefixMatch(lens, best, best_inst)


def _instances(mask: int) -> list[int]:
    """The instance ids whose bits `mask` has, lowest first."""
    out = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return out


@dataclass(slots=True)
class PrefillLoad:
    instance_id: int
    busy_until_s: float = 0.0
    """When the work already queued on this instance is predicted to finish."""
    nic_busy_until_s: float = 0.0
    """When this node's NIC finishes the transfers it is already sending (sender congestion)."""
    num_queued: int = 0

    def queue_s(self, now: float) -> float:
        return max(0.0, self.busy_until_s - now)


@dataclass(slots=True)
class DecodeLoad:
    instance_id: int
    kv_capacity_tokens: int
    num_active: int = 0
    """Requests whose KV has arrived (running or waiting for VRAM)."""
    active_tokens: int = 0
    num_assigned: int = 0
    """Active requests plus accepted ones still in prefill or transfer."""
    assigned_tokens: int = 0
    planned: dict[int, tuple[float, int]] = field(default_factory=dict)
    """request id -> (decode start, context tokens), predicted until the request starts."""
    recent_starts: deque[float] = field(default_factory=deque)
    """Decode starts of the last JOIN_WINDOW_S seconds (the join rate the TBT prediction
    needs, kvpool.conductor.decode.tbt_statistic_s)."""

    def join_rate(self) -> float:
        """Requests joining this instance's batch per second, over the recent window."""
        return len(self.recent_starts) / JOIN_WINDOW_S


@dataclass(slots=True)
class ClusterView:
    prefill: list[PrefillLoad]
    decode: list[DecodeLoad]
    index: PrefixIndex = field(default_factory=PrefixIndex)
    colocated: dict[int, int] = field(default_factory=dict)
    """Prefill instance id -> the decode instance of the same worker, for workers that do
    both (a request prefilled there decodes there: the colocated layout)."""

    @classmethod
    def create(cls, num_prefill: int, num_decode: int, kv_capacity_tokens: int) -> ClusterView:
        if num_prefill <= 0 or num_decode < 0:
            raise InvalidArgument(
                f"need num_prefill > 0 and num_decode >= 0, got {num_prefill}, {num_decode}")
        return cls([PrefillLoad(i) for i in range(num_prefill)],
                   [DecodeLoad(i, kv_capacity_tokens) for i in range(num_decode)])

    def record_accept(self, req: RequestInfo, decision: Accepted, now: float) -> None:
        """Book an accepted request: prefill queue, sender NIC, decode assignment."""
        choice = decision.prefill
        p = self.prefill[choice.instance_id]
        p.busy_until_s = max(p.busy_until_s, now) + choice.wait_s + choice.transfer_s \
            + choice.prefill_s
        p.num_queued += 1
        if choice.source_id is not None and choice.transfer_s > 0:  # (its wait is this)
            src = self.prefill[choice.source_id]
            src.nic_busy_until_s = max(src.nic_busy_until_s, now) + choice.transfer_s
        if self.decode:
            d = self.decode[decision.decode.instance_id]
            d.num_assigned += 1
            d.assigned_tokens += req.input_len
            d.planned[req.request_id] = (now + choice.ttft_s, req.input_len)

    def record_decode_moved(self, decode_id: int, req: RequestInfo, now: float) -> None:
        """A request's decode moved to instance `decode_id` (migration): assigned there;
        `record_decode_start` follows with its first token."""
        d = self.decode[decode_id]
        d.num_assigned += 1
        d.assigned_tokens += req.input_len
        d.planned[req.request_id] = (now, req.input_len)

    def record_prefill_done(self, instance_id: int) -> None:
        self.prefill[instance_id].num_queued -= 1

    def record_decode_start(self, decode_id: int, req: RequestInfo, now: float) -> None:
        d = self.decode[decode_id]
        d.num_active += 1
        d.active_tokens += req.input_len
        d.planned[req.request_id] = (now, req.input_len)
        d.recent_starts.append(now)
        while d.recent_starts and d.recent_starts[0] < now - JOIN_WINDOW_S:
            d.recent_starts.popleft()

    def record_decode_end(self, decode_id: int, req: RequestInfo, started: bool) -> None:
        """The request left decode instance `decode_id` (finished, or rejected/failed before)."""
        d = self.decode[decode_id]
        d.num_assigned -= 1
        d.assigned_tokens -= req.input_len
        if started:
            d.num_active -= 1
            d.active_tokens -= req.input_len
        d.planned.pop(req.request_id, None)
