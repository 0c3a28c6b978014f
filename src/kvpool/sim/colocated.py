"""The colocated vLLM-like baseline: every instance runs both prefill and decode.

Per instance, the scheduling of vLLM v0.5.1 as deployed in [F] (each behaviour below that is
marked with a `VllmConfig` field can be switched off):
- default scheduler (no chunked prefill): waiting prompts have priority; several of them are
  batched into one prefill step up to `max_num_batched_tokens` (`batch_prefills`), and every
  running request's next token waits for the whole prefill step;
- no prompt starts while `max_num_seqs` sequences are running or starting (1 = one request
  at a time: the next prompt waits until the running request has finished decoding);
- chunked prefill: each step carries the running decodes plus up to `chunk_tokens` prompt
  tokens (minus one per running sequence), filled from the prompt in progress and then from
  the next waiting ones (`batch_prefills`); it is one forward pass, so the decode step's
  fixed term (reading the weights) is paid once, under the chunk's compute, and the decodes
  add their per-sequence and per-token terms; every step that carries a chunk also pays
  `chunk_overhead_s` (it runs eagerly);
- decode-only steps replay a CUDA graph while every context is within
  `max_seq_len_to_capture` (8192) and run eagerly, paying `eager_decode_s`, above it;
- prefix caching: the instance's own GPU cache (LRU) lets a prompt skip its cached leading
  blocks. Cached blocks live in the VRAM that running requests leave free
  (`shared_vram_cache`). There is no cache sharing between instances;
- KV is allocated as tokens are produced; a prompt starts when its KV fits beside the running
  requests' (1% watermark); when a decode step finds no free slot, the newest running request
  is preempted by recomputation: its KV is dropped and it is prefilled again (prompt plus the
  tokens it produced) ahead of the waiting prompts (`preempt_recompute`). Off: a request
  reserves input + output tokens when it starts and is never preempted.
Requests are dispatched round-robin (or to the instance with the fewest outstanding requests);
there is no admission control: every request is served, however late.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

from tqdm import tqdm

from kvpool.conductor.cost import CostModel
from kvpool.engine.emulated.step_cost import PromptChunk, StepWork, chunk_s, step_s
from kvpool.errors import ConfigError
from kvpool.sim.cache import BlockCache
from kvpool.sim.engine import BatchEngine, EngineConfig, Hook
from kvpool.sim.events import EventLoop
from kvpool.sim.metrics import SimResult
from kvpool.sim.record import SimRequest, top_share_mean
from kvpool.sim.trace import TraceRequest
from kvpool.sim.vllm import CHUNK_OVERHEAD_S, VllmConfig

__all__ = ["CHUNK_OVERHEAD_S", "ColocatedConfig", "ColocatedEngine", "ColocatedSim",
           "VllmConfig"]

DISPATCH = ("round_robin", "least_loaded")
Work = list[tuple[SimRequest, int]]


def _prompt_len(sr: SimRequest) -> int:
    """Tokens a prefill computes: the prompt, plus the produced tokens for a recomputation."""
    return sr.req.input_len + (1 + sr.decoded if sr.num_preempted else 0)


@dataclass(frozen=True, slots=True)
class ColocatedConfig:
    num_instances: int = 16
    engine: EngineConfig = field(default_factory=EngineConfig)
    dispatch: str = "round_robin"
    block_size: int = 512
    vllm: VllmConfig = field(default_factory=VllmConfig)

    def __post_init__(self) -> None:
        if self.num_instances <= 0:
            raise ConfigError(f"num_instances must be > 0, got {self.num_instances}")
        if self.dispatch not in DISPATCH:
            raise ConfigError(f"dispatch must be one of {DISPATCH}, got {self.dispatch!r}")


class ColocatedEngine(BatchEngine):
    def __init__(self, engine_id: int, cost: CostModel, config: EngineConfig, loop: EventLoop,
                 on_finish: Hook, block_size: int, vllm: VllmConfig | None = None) -> None:
        super().__init__(engine_id, cost, config, loop, on_finish)
        self.block_size = block_size
        self.vllm = vllm or VllmConfig()
        self.rules = self.vllm.step_rules(chunked=bool(config.chunk_tokens))
        self.cache = (BlockCache(config.prefix_cache_blocks, "lru")
                      if config.prefix_cache_blocks else None)
        self._prefilling: list[SimRequest] = []
        """Prompts started and not yet fully computed (chunked prefill), in order."""
        self.num_preempted = 0
        self.peak_kv_held = 0
        """Most KV tokens held at once: allocated (preemption on) or reserved (off)."""

    # ---- choosing the prefill work of the next step
    def _next_prefill(self) -> Work:
        if self.config.chunk_tokens:
            return self._chunk_work()
        return self._whole_work()  # a whole-prompt step leaves nothing half done

    def _whole_work(self) -> Work:
        work: Work = []
        tokens = pending = 0
        while self.prefill_queue and self._seq_room():
            sr = self.prefill_queue[0]
            if work and not self._fits_batch(tokens + _prompt_len(sr)):
                break
            if not self._kv_fits(sr, pending, bool(work)):
                break
            self._start_prompt()
            work.append((sr, _prompt_len(sr) - sr.prefilled_tokens))
            tokens += _prompt_len(sr)
            pending += self._hold(sr)
        return work

    def _fits_batch(self, tokens: int) -> bool:
        v = self.vllm
        return v.batch_prefills and tokens <= v.max_num_batched_tokens

    def _seq_room(self) -> bool:
        """Another prompt may start: the running, joining and prefilling sequences stay
        within `max_num_seqs` (vLLM's limit on the sequences it runs at once)."""
        held = len(self.running) + len(self.waiting) + len(self._prefilling)
        return held < self.vllm.max_num_seqs

    def _chunk_work(self) -> Work:
        if self.running:
            self._make_room(self.loop.now)  # running decodes are scheduled first
        budget = max(1, self.config.chunk_tokens - len(self.running))
        work: Work = []
        pending = sum(self._hold(s) for s in self._prefilling)
        for sr in self._prefilling:
            if budget <= 0 or (work and not self.vllm.batch_prefills):
                return work
            take = min(budget, _prompt_len(sr) - sr.prefilled_tokens)
            work.append((sr, take))
            budget -= take
        while (budget > 0 and self.prefill_queue and self._seq_room()
               and (self.vllm.batch_prefills or not work)):
            sr = self.prefill_queue[0]
            if not self._kv_fits(sr, pending, bool(work or self._prefilling)):
                break
            self._start_prompt()
            take = min(budget, _prompt_len(sr) - sr.prefilled_tokens)
            work.append((sr, take))
            budget -= take
            pending += self._hold(sr)
        return work

    # ---- KV memory
    def _hold(self, sr: SimRequest) -> int:
        """KV tokens a starting prompt claims: its prompt (on demand) or input + output."""
        if self.vllm.preempt_recompute:
            return _prompt_len(sr)
        return sr.req.input_len + sr.req.output_len

    def _held(self) -> int:
        """KV tokens held now by the running and the prefilling requests."""
        if not self.vllm.preempt_recompute:
            return self.kv_reserved
        return self.context_tokens + sum(_prompt_len(s) for s in self._prefilling)

    def _kv_fits(self, sr: SimRequest, pending: int, others: bool) -> bool:
        if not (self.running or others):
            return True
        cap = self.config.kv_capacity_tokens
        if self.vllm.preempt_recompute:
            cap = int(cap * (1.0 - self.vllm.watermark))
            return self._held() + pending + self._hold(sr) <= cap
        return self.kv_reserved + pending + self._hold(sr) <= cap

    def _admit(self, now: float) -> None:
        if not self.vllm.preempt_recompute:
            super()._admit(now)
            return
        while self.waiting:  # their KV was allocated when their prefill started
            sr = self.waiting.popleft()
            self._join(sr, now, sr.req.input_len + sr.req.output_len)
        self.peak_kv_held = max(self.peak_kv_held, self._held())  # held grows until a boundary

    def _make_room(self, now: float) -> None:
        """Before a decode step: every running request needs one more KV slot."""
        if not self.vllm.preempt_recompute:
            return
        cap = self.config.kv_capacity_tokens
        while len(self.running) > 1 and self._held() + len(self.running) > cap:
            self._preempt(max(self.running.values(),
                              key=lambda s: (s.req.arrival_s, s.req.request_id)), now)
        self.peak_kv_held = max(self.peak_kv_held, self._held() + len(self.running))

    def _decode_steps(self) -> int:
        steps = super()._decode_steps()
        graph_max = self.vllm.max_seq_len_to_capture
        longest = self._longest_context()
        if graph_max and longest <= graph_max:
            steps = min(steps, graph_max - longest + 1)  # the step after runs eagerly
        if not self.vllm.preempt_recompute:
            return steps
        free = self.config.kv_capacity_tokens - self._held()
        return max(1, min(steps, free // len(self.running)))

    def _preempt(self, sr: SimRequest, now: float) -> None:
        """Drop `sr`'s KV; it is prefilled again (prompt + produced tokens) before any prompt."""
        del self.running[sr.req.request_id]
        self._finish_heap = [(f, rid) for f, rid in self._finish_heap
                             if rid != sr.req.request_id]
        heapq.heapify(self._finish_heap)
        self._leave(sr)
        gaps, trailing = self._residency_gaps(sr)
        sr.prior_gaps.extend(gaps)
        sr.last_token_s = now - trailing
        sr.decoded += self.steps_done - sr.join_step
        sr.num_preempted += 1
        sr.prefilled_tokens = 0
        self.num_preempted += 1
        self.prefill_queue.appendleft(sr)

    def _start_prompt(self) -> SimRequest:
        sr = self.prefill_queue.popleft()
        blocks = self.cache.prefix_blocks(sr.req.block_hashes) if self.cache else 0
        sr.prefix_len = min(blocks * self.block_size, sr.req.input_len)
        sr.prefilled_tokens = sr.prefix_len
        if not sr.num_preempted:
            sr.reused_tokens = sr.prefix_len
        self._prefilling.append(sr)
        held = sum(self._hold(s) for s in self._prefilling)
        base = self.kv_reserved if not self.vllm.preempt_recompute else self.context_tokens
        self.peak_kv_held = max(self.peak_kv_held, base + held)
        return sr

    # ---- cost of a step
    def _prefill_step_s(self, work: Work) -> float:
        """The step's seconds (emulated/step_cost.py), and each prompt's share of them in its
        `prefill_gpu_s`: its chunk, the shared prefill base and overhead by its tokens."""
        chunks = [self._chunk(sr, tokens) for sr, tokens in work]
        decodes = len(self.running) if self.config.chunk_tokens else 0
        self._stall = not self.config.chunk_tokens  # a whole-prompt step pauses every decode
        step = step_s(self.cost, self.rules, StepWork(
            tuple(chunks), decodes, self.context_tokens if decodes else 0))
        r = self.rules
        shared = self.cost.prefill_base_s / len(work) if r.shared_base else 0.0
        overhead = r.chunk_overhead_s if (decodes or r.overhead_alone) else 0.0
        total_tokens = sum(t for _, t in work) or 1
        for (sr, tokens), ch in zip(work, chunks, strict=True):
            sr.prefill_gpu_s += (chunk_s(self.cost, r, ch) + shared
                                 + overhead * tokens / total_tokens)
        return step

    def _chunk(self, sr: SimRequest, tokens: int) -> PromptChunk:
        """The chunk of `sr` in this step: its first after the cached prefix pays the base."""
        start = sr.prefilled_tokens
        return PromptChunk(start, tokens, first=start == sr.prefix_len)

    # ---- end of a step
    def _finish_prefill(self, now: float) -> None:
        for sr, tokens in self._work:
            sr.prefilled_tokens += tokens
            if sr.prefilled_tokens >= _prompt_len(sr):
                self._prefilling.remove(sr)
                if sr.num_preempted:
                    self._recomputed(sr, now)
                else:
                    self._first_token(sr, now)

    def _first_token(self, sr: SimRequest, now: float) -> None:
        sr.first_token_s = now
        if self.cache is not None:
            self._fit_cache()
            self.cache.access(sr.req.block_hashes)
        if sr.req.output_len <= 1:
            sr.finish_s = now
            self.on_finish(sr, now)
        else:
            self.waiting.append(sr)

    def _recomputed(self, sr: SimRequest, now: float) -> None:
        """A preempted request's prefill again: it yields its next token and rejoins."""
        assert sr.last_token_s is not None
        sr.prior_gaps.append((now - sr.last_token_s, 1))
        sr.last_token_s = now
        sr.decoded += 1
        if sr.decoded >= sr.req.output_len - 1:
            assert sum(c for _, c in sr.prior_gaps) == sr.req.output_len - 1, sr
            sr.finish_s = now
            sr.tbt_s = top_share_mean(sr.prior_gaps)
            self.on_finish(sr, now)
        else:
            self.waiting.append(sr)

    def check_integrity(self) -> None:
        if not self.vllm.preempt_recompute:
            super().check_integrity()
            return
        assert len(self._finish_heap) == len(self.running)
        held = sum(s.req.input_len + s.decoded + self.steps_done - s.join_step
                   for s in self.running.values())
        assert held == self.context_tokens
        assert self._held() <= self.config.kv_capacity_tokens or len(self.running) <= 1

    def _fit_cache(self) -> None:
        """Shrink the prefix cache to the VRAM the running requests' KV leaves free."""
        assert self.cache is not None
        total = self.config.prefix_cache_blocks
        if not self.vllm.shared_vram_cache:
            return
        in_use = -(-self.kv_reserved // self.block_size)
        self.cache.resize(max(1, total - in_use))


class ColocatedSim:
    def __init__(self, cost: CostModel, config: ColocatedConfig | None = None,
                 ttft_slo_s: float = 30.0, tbt_slo_s: float = 0.1) -> None:
        self.cost = cost
        self.config = cfg = config or ColocatedConfig()
        self.ttft_slo_s, self.tbt_slo_s = ttft_slo_s, tbt_slo_s
        self.loop = EventLoop()
        self.instances = [ColocatedEngine(i, cost, cfg.engine, self.loop, self._finished,
                                          cfg.block_size, cfg.vllm)
                          for i in range(cfg.num_instances)]
        self._rr = 0

    def run(self, requests: Sequence[TraceRequest], progress: bool = False) -> SimResult:
        records = [SimRequest(r) for r in requests]
        bar = tqdm(total=len(records), disable=not progress, desc="simulating", unit="req")
        if records:
            self.loop.at(records[0].req.arrival_s, self._arrive, records, 0, bar)
        self.loop.run()
        bar.close()
        return SimResult(records, self.ttft_slo_s, self.tbt_slo_s, [], self.loop.num_events)

    def _arrive(self, records: list[SimRequest], i: int, bar: tqdm) -> None:
        if i + 1 < len(records):
            self.loop.at(records[i + 1].req.arrival_s, self._arrive, records, i + 1, bar)
        bar.update(1)
        self._pick().submit_prefill(records[i], self.loop.now)

    def _pick(self) -> ColocatedEngine:
        if self.config.dispatch == "least_loaded":
            return min(self.instances, key=lambda e: (e.outstanding(), e.engine_id))
        inst = self.instances[self._rr % len(self.instances)]
        self._rr += 1
        return inst

    def peak_kv_share(self) -> float:
        """Highest share of an instance's VRAM KV capacity ever held (allocated on demand, or
        reserved when preemption is off)."""
        cap = self.config.engine.kv_capacity_tokens
        return max(e.peak_kv_held for e in self.instances) / cap

    def num_preempted(self) -> int:
        return sum(e.num_preempted for e in self.instances)

    def _finished(self, sr: SimRequest, now: float) -> None:
        return None
