"""Which tokens each step computes: continuous batching with chunked prefill.

Every running sequence has some tokens without KV: a decode step has one (the token sampled
last), a prompt has many. One step computes one token of every decoding sequence plus prompt
chunks of at most `max_prefill_chunk` tokens in all; new sequences are admitted while there is
room in the batch and in the KV cache. When a decoding sequence needs a block and none is free,
the most recently admitted sequence is preempted (its blocks freed; it recomputes later).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from kvpool.engine.block_manager import BlockManager
from kvpool.engine.config import EngineConfig
from kvpool.engine.sequence import KVSource, SeqStatus, Sequence

ScheduledBatch = list[tuple[Sequence, int]]  # (sequence, tokens to compute now)
AdmitHook = Callable[[Sequence], None]       # loads KV from elsewhere; may finish the seq


class Scheduler:
    def __init__(self, config: EngineConfig, blocks: BlockManager) -> None:
        self.config = config
        self.blocks = blocks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A sequence whose blocks are already allocated (pushed KV)."""
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, on_admit: AdmitHook) -> ScheduledBatch:
        budget = self.config.max_prefill_chunk
        batch: ScheduledBatch = []
        for seq in list(self.running):
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted while making room for an earlier one
            if seq.num_uncomputed == 1:
                if self._make_room(seq):
                    batch.append((seq, 1))
            elif budget > 0:
                n = min(seq.num_uncomputed, budget)
                budget -= n
                batch.append((seq, n))
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            hits = self.blocks.match_prefix(seq)
            if not self.blocks.can_allocate(seq, hits):
                break
            self.waiting.popleft()
            self.blocks.allocate(seq, hits)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            on_admit(seq)
            if seq.status is SeqStatus.FINISHED or seq.num_uncomputed == 0:
                continue
            n = min(seq.num_uncomputed, budget)
            budget -= n
            batch.append((seq, n))
        return batch

    def _make_room(self, seq: Sequence) -> bool:
        while not self.blocks.can_append(seq):
            victim = self.running[-1]
            self.preempt(victim)
            if victim is seq:
                return False
        self.blocks.append(seq)
        return True

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.status, seq.num_computed_tokens = SeqStatus.WAITING, 0
        seq.kv_source = KVSource.COMPUTE
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq)
        seq.status = SeqStatus.FINISHED

    def find(self, request_id: str) -> Sequence | None:
        for seq in (*self.running, *self.waiting):
            if seq.request_id == request_id:
                return seq
        return None
