"""Which tokens each step computes: continuous batching with chunked prefill.

Every running sequence has some tokens without KV: a decode step has one (the token sampled
last), a prompt has many. One step computes one token of every decoding sequence plus prompt
chunks of at most `max_prefill_chunk` tokens in all; new sequences are admitted while there is
room in the batch and in the KV cache. When a decoding sequence needs a block and none is free,
the most recently admitted sequence is preempted (its blocks freed; it recomputes later).

With `prefill_mode="whole"` (vLLM's old default scheduler) a step is either whole prompts
(admitted while they fit `max_prefill_chunk` tokens, at least one) or the decodes: waiting
prompts go first, and every running decode waits for their step. `max_prefill_seqs` caps the
prompts one step computes; `enable_prefix_caching=False` ignores the local cache's hits.
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
        if self.config.prefill_mode == "whole":
            return self._whole_prompts(on_admit) or self._decodes()
        budget = self.config.max_prefill_chunk
        batch: ScheduledBatch = []
        prompts = 0
        room = self.blocks.block_size
        for seq in list(self.running):
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted while making room for an earlier one
            length = len(seq.token_ids)
            if length - seq.num_computed_tokens == 1:  # a decode
                # its last block has room (most steps), else _make_room's work
                if length <= len(seq.block_table) * room or self._make_room(seq):
                    batch.append((seq, 1))
            elif budget > 0 and self._prompt_room(prompts):
                n = min(seq.num_uncomputed, budget)
                budget, prompts = budget - n, prompts + 1
                batch.append((seq, n))
        while budget > 0 and self._prompt_room(prompts) and (new := self._admit_next(on_admit)):
            if new.status is SeqStatus.FINISHED or new.num_uncomputed == 0:
                continue
            n = min(new.num_uncomputed, budget)
            budget, prompts = budget - n, prompts + 1
            batch.append((new, n))
        return batch

    def _prompt_room(self, prompts: int) -> bool:
        return not self.config.max_prefill_seqs or prompts < self.config.max_prefill_seqs

    def _admit_next(self, on_admit: AdmitHook, max_tokens: int | None = None) -> Sequence | None:
        """Admit the first waiting sequence if the batch and the cache have room for it (and,
        with `max_tokens`, its tokens to compute fit); None otherwise."""
        if not self.waiting or len(self.running) >= self.config.max_num_seqs:
            return None
        seq = self.waiting[0]
        reuse = self.config.enable_prefix_caching and seq.reuses_kv
        hits = self.blocks.match_prefix(seq) if reuse else []
        if not self.blocks.can_allocate(seq, hits):
            return None
        if max_tokens is not None and len(seq) - len(hits) * self.blocks.block_size > max_tokens:
            return None
        self.waiting.popleft()
        self.blocks.allocate(seq, hits)
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)
        on_admit(seq)
        return seq

    def _whole_prompts(self, on_admit: AdmitHook) -> ScheduledBatch:
        """A step of whole prompts: the first that fits the cache, then more while their
        tokens stay within the budget."""
        batch: ScheduledBatch = []
        budget = self.config.max_prefill_chunk
        while self._prompt_room(len(batch)):
            seq = self._admit_next(on_admit, budget if batch else None)
            if seq is None:
                break
            if seq.status is SeqStatus.FINISHED or seq.num_uncomputed == 0:
                continue
            budget -= seq.num_uncomputed
            batch.append((seq, seq.num_uncomputed))
        return batch

    def _decodes(self) -> ScheduledBatch:
        batch: ScheduledBatch = []
        for seq in list(self.running):
            if seq.status is SeqStatus.RUNNING and seq.num_uncomputed == 1 and self._make_room(seq):
                batch.append((seq, 1))
        return batch

    def _make_room(self, seq: Sequence) -> bool:
        if len(seq.token_ids) <= len(seq.block_table) * self.blocks.block_size:
            return True  # its last block has room (most decode steps)
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
        if not seq.prompt_logprobs_sent:
            seq.prompt_logprobs.clear()
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
