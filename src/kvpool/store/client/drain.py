"""The client side of draining a store node: copy its objects to the ranges the master
allocates elsewhere, verified, in batches.

A `NodeDrainer` is a store client without mounted memory. For each batch of moves it reads
every object from its closest complete replica into its staging buffer (falling back to the
other replicas; bytes that fail the object's checksum are never written anywhere), writes
the verified bytes to the pending target range, and tells the master which copies are
good (REPLICATE_END). Only then does the new replica replace the drained one, so a drain
interrupted at any point loses nothing: the object keeps its old replica until the swap.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvpool.errors import RpcFailed
from kvpool.store.client.base import ClientBase
from kvpool.store.client.plan import copies_for
from kvpool.store.wire import messages as m
from kvpool.store.wire.codes import ErrorCode, LookupResult, Tier
from kvpool.store.wire.drain import DrainPlan, DrainStep, ReplicaMove
from kvpool.transfer import OpCode

E = ErrorCode
WAIT_S = 0.1
"""Pause between batches while only puts or moves in flight are left on the node."""


@dataclass
class DrainReport:
    """Running totals of one drain (the progress lines and the summary print these)."""

    plan: DrainPlan
    moved: int = 0
    moved_bytes: int = 0
    dropped: int = 0
    """Objects whose drained replica was dropped: another replica stays, and no further
    segment had room for a new one."""
    dropped_bytes: int = 0
    changed: int = 0
    """Objects removed or replaced while being moved (their new version is elsewhere)."""
    unplaced: dict[str, ErrorCode] = field(default_factory=dict)
    """Objects left on the node, with the reason."""
    unplaced_bytes: int = 0
    elapsed_s: float = 0.0
    complete: bool = False
    """The master found nothing left on the node but the unplaced objects."""

    @property
    def ok(self) -> bool:
        return self.complete and not self.unplaced

    def reasons(self) -> collections.Counter[str]:
        return collections.Counter(code.name for code in self.unplaced.values())


class NodeDrainer(ClientBase):
    """Drains one address; `progress(report)` is called after every batch."""

    def begin(self, address: str, dry_run: bool = False) -> DrainPlan:
        """The drain's plan (SEGMENT_NOT_FOUND: no such node); without `dry_run` the node's
        segments take no new placements from now on. RpcFailed when the master cannot be
        asked."""
        plan: DrainPlan = self._call(m.DrainBeginMsg(address=address, dry_run=dry_run))
        return plan

    def cancel(self, address: str) -> ErrorCode:
        """Let the node take placements again (objects moved so far stay moved)."""
        try:
            return ErrorCode(self._call(m.DrainEndMsg(address=address)))
        except RpcFailed as exc:
            return exc.code

    def run(self, address: str, plan: DrainPlan, batch_keys: int = 256,
            progress: Callable[[DrainReport], None] | None = None,
            timeout_s: float = 3600.0) -> DrainReport:
        """Move everything off `address` (after `begin`). Ends when the master reports the
        node empty but for objects that could not be placed (`complete`), when the drain
        ended elsewhere, or after `timeout_s`. RpcFailed when the master stops answering."""
        report = DrainReport(plan)
        clock = self.clock
        start = clock.now()
        max_bytes = max(1, self.config.local_buffer_size // 2)
        while clock.now() - start < timeout_s:
            t0 = self.clock.now()  # the leases of this batch's objects start after this
            step: DrainStep = self._call(m.ReplicateStartMsg(
                address=address, max_keys=batch_keys, max_bytes=max_bytes))
            if step.code != E.OK:
                break
            self._account(report, step)
            if step.moves:
                self._move(report, step.moves, t0)
            report.elapsed_s = clock.now() - start
            if progress is not None and (step.moves or step.num_dropped or step.unplaced):
                progress(report)
            if step.done:
                report.complete = True
                break
            if not step.moves:
                clock.sleep(WAIT_S)
        report.elapsed_s = clock.now() - start
        return report

    @staticmethod
    def _account(report: DrainReport, step: DrainStep) -> None:
        report.dropped += step.num_dropped
        report.dropped_bytes += step.dropped_bytes
        for item in step.unplaced:
            report.unplaced[item.key] = item.code
            report.unplaced_bytes += item.size

    def _move(self, report: DrainReport, moves: Sequence[ReplicaMove], t0: float) -> None:
        """Copy one batch through the staging buffer and report each outcome to the
        master."""
        looks = self._sources(moves)
        staged = [self._staging.acquire(mv.size) for mv in moves]
        try:
            reads = self._read([mv.key for mv in moves], looks,
                               [[(addr, mv.size)] for (addr, _, _), mv
                                in zip(staged, moves, strict=True)], t0)
            copies = {i: copies_for([(staged[i][0], mv.size)], mv.target, mv.size)
                      for i, (mv, r) in enumerate(zip(moves, reads, strict=True)) if r.ok}
            failed = self._run_copies(OpCode.WRITE, copies)
        finally:
            for _, _, token in staged:
                self._staging.release(token)
        codes = [int(E.TRANSFER_FAIL) if i in failed else int(r.code)
                 for i, r in enumerate(reads)]
        ended = self._call(m.ReplicateEndMsg(keys=[mv.key for mv in moves], codes=codes))
        for move, code, answer in zip(moves, codes, ended, strict=True):
            self._tally(report, move, code, answer)

    def _sources(self, moves: Sequence[ReplicaMove]) -> list[LookupResult]:
        """Where to read each move from: its DRAM copies; an object only on a node's disk
        is looked up like a get, which has the master load it into DRAM elsewhere first.
        The move's checksum stays the reference, so an object replaced meanwhile fails the
        read instead of being copied."""
        looks = [LookupResult(E.OK, mv.size, mv.sources, mv.lease_ttl_s, mv.checksum)
                 for mv in moves]
        on_disk = [i for i, mv in enumerate(moves)
                   if not any(r.tier is Tier.DRAM for r in mv.sources)]
        if on_disk:
            fresh, _ = self._lookup([moves[i].key for i in on_disk])
            for i, look in zip(on_disk, fresh, strict=True):
                looks[i] = look._replace(checksum=moves[i].checksum) \
                    if look.code is E.OK else look
        return looks

    @staticmethod
    def _tally(report: DrainReport, move: ReplicaMove, code: int, answer: Any) -> None:
        if code != 0:
            report.unplaced[move.key] = ErrorCode(code)
            report.unplaced_bytes += move.size
        elif answer == E.OK:
            report.moved += 1
            report.moved_bytes += move.size
        elif answer == E.OBJECT_NOT_FOUND:
            report.changed += 1
        # else the master discarded the move (it outlived put_discard_timeout_s): the
        # object is offered again

    def __enter__(self) -> NodeDrainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
