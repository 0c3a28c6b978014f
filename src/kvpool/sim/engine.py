"""One simulated GPU instance that runs continuous-batching steps.

Decode work: requests whose KV has arrived wait in `waiting`, join the batch at the next step
boundary when their KV reservation (input + output tokens) fits in VRAM, and leave after
output_len - 1 steps (the first token came from prefill). Optional prefill work (the colocated
baseline): requests in `prefill_queue` are computed whole between decode steps (vLLM without
chunked prefill: decodes stall) or in chunks folded into decode steps (chunked prefill).

Time advances in *segments*: runs of k identical steps between two batch changes, so a step is
never simulated one by one unless a prefill chunk rides on it. A request's inter-token gaps are
read back from the segments it lived through when it finishes.

    seg_start            boundary = seg_start + k*dt             wake
    |--dt--|--dt--|--dt--|--dt--| ... a join cuts the segment at the next boundary
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from kvpool.conductor.cost import CostModel
from kvpool.engine.emulated.step_cost import StepRules, StepWork, step_s
from kvpool.errors import ConfigError
from kvpool.sim.events import EventLoop
from kvpool.sim.record import SimRequest, top_share_mean

Hook = Callable[[SimRequest, float], None]


@dataclass(frozen=True, slots=True)
class EngineConfig:
    kv_capacity_tokens: int = 1_300_000
    """KV tokens that fit in VRAM: 8 x 80 GB minus 140 GB of weights and activations, at
    320 KiB per token."""
    chunk_tokens: int = 0
    """Chunked prefill token budget per step (0 = prefill whole, stalling decodes)."""
    prefix_cache_blocks: int = 0
    """Colocated baseline's GPU prefix cache in blocks (0 = prefix caching off)."""
    remote_kv: bool = False
    """Requests join with KV transferred from a prefill instance (disaggregated decode): the
    step in which they join takes `CostModel.decode_join_s` longer per joining request. Off
    where the KV was computed in place (the colocated baseline)."""

    def __post_init__(self) -> None:
        if self.kv_capacity_tokens <= 0:
            raise ConfigError(f"kv_capacity_tokens must be > 0, got {self.kv_capacity_tokens}")
        if self.chunk_tokens < 0 or self.prefix_cache_blocks < 0:
            raise ConfigError("chunk_tokens and prefix_cache_blocks must be >= 0")


class BatchEngine:
    def __init__(self, engine_id: int, cost: CostModel, config: EngineConfig, loop: EventLoop,
                 on_finish: Hook, on_first_token: Hook | None = None) -> None:
        self.engine_id = engine_id
        self.cost = cost
        self.config = config
        self.loop = loop
        self.on_finish = on_finish
        self.on_first_token = on_first_token
        self.waiting: deque[SimRequest] = deque()
        self.prefill_queue: deque[SimRequest] = deque()
        self.running: dict[int, SimRequest] = {}
        self._finish_heap: list[tuple[int, int]] = []
        self.steps_done = 0
        self.kv_reserved = 0
        self._in_sum = 0
        self._join_sum = 0
        self.seg_dt: list[float] = []
        self.seg_k: list[int] = []
        self.busy = False
        self._seg_start = 0.0
        self._dt = 0.0
        self._wake_k = 0
        self._work: list[tuple[SimRequest, int]] = []
        """Prefill work of the current step: (request, prompt tokens) pairs."""
        self._stall = False
        """The current step is a whole prefill: running requests get no token from it."""
        self._version = 0
        self._joined = 0
        """Requests that joined the batch at the current boundary."""
        self.prefill_gpu_s = 0.0
        self.peak_kv_reserved = 0
        """Most KV tokens ever reserved at once (input + output of the running requests)."""
        self.rules = StepRules()
        """How a step is charged (emulated/step_cost.py, shared with the emulated engine):
        a decode instance's steps are decode-only, its joins pay `decode_join_s`."""

    # ---- questions
    @property
    def batch_size(self) -> int:
        return len(self.running)

    @property
    def context_tokens(self) -> int:
        return self._in_sum + len(self.running) * self.steps_done - self._join_sum

    def outstanding(self) -> int:
        return len(self.running) + len(self.waiting) + len(self.prefill_queue)

    # ---- actions
    def submit_decode(self, sr: SimRequest, now: float) -> None:
        """KV of `sr` is in this instance's memory; it joins at the next step boundary."""
        self.waiting.append(sr)
        self._poke(now)

    def submit_prefill(self, sr: SimRequest, now: float) -> None:
        self.prefill_queue.append(sr)
        self._poke(now)

    def _poke(self, now: float) -> None:
        if not self.busy:
            self._boundary(now, 0)
            return
        k = max(1, math.ceil((now - self._seg_start) / self._dt - 1e-9))
        if k < self._wake_k:
            self._schedule(self._seg_start + k * self._dt, k)

    def _schedule(self, when: float, k: int) -> None:
        self._version += 1
        self._wake_k = k
        self.loop.at(when, self._wake, self._version)

    def _wake(self, version: int) -> None:
        if version == self._version:
            self._boundary(self.loop.now, self._wake_k)

    def _boundary(self, now: float, k: int) -> None:
        if self.busy:
            self._close_segment(now, k)
        self._admit(now)
        self._plan(now)

    def _close_segment(self, now: float, k: int) -> None:
        decoded = 0 if self._stall else k
        self.seg_dt.append(self._dt)
        self.seg_k.append(decoded)
        self.steps_done += decoded
        self._finish_prefill(now)
        while self._finish_heap and self._finish_heap[0][0] <= self.steps_done:
            _, rid = heapq.heappop(self._finish_heap)
            self._finish(self.running.pop(rid), now)

    def _finish(self, sr: SimRequest, now: float) -> None:
        self._leave(sr)
        sr.finish_s = now
        gaps = sr.prior_gaps + self._residency_gaps(sr)[0]
        assert sum(c for _, c in gaps) == max(1, sr.req.output_len - 1), sr
        sr.tbt_s = top_share_mean(gaps)
        self.on_finish(sr, now)

    def _leave(self, sr: SimRequest) -> None:
        """Undo the bookkeeping of `_join` (the request is already out of `running`)."""
        self._in_sum -= sr.req.input_len + sr.decoded
        self._join_sum -= sr.join_step
        self.kv_reserved -= sr.req.input_len + sr.req.output_len

    def _residency_gaps(self, sr: SimRequest) -> tuple[list[tuple[float, int]], float]:
        """Gaps between the tokens of the current residency, and the time since its last
        token (the trailing steps in which it got none)."""
        last = sr.first_token_s if sr.last_token_s is None else sr.last_token_s
        assert last is not None
        carry = sr.join_s - last
        gaps: list[tuple[float, int]] = []
        for dt, k in zip(self.seg_dt[sr.join_seg:], self.seg_k[sr.join_seg:], strict=True):
            if k == 0:
                carry += dt
                continue
            gaps.append((carry + dt, 1))
            gaps.append((dt, k - 1))
            carry = 0.0
        return gaps, carry

    def _admit(self, now: float) -> None:
        cap = self.config.kv_capacity_tokens
        while self.waiting:
            sr = self.waiting[0]
            need = sr.req.input_len + sr.req.output_len
            if self.running and self.kv_reserved + need > cap:
                break
            self.waiting.popleft()
            self._join(sr, now, need)

    def _join(self, sr: SimRequest, now: float, need: int) -> None:
        sr.engine_id = self.engine_id
        sr.join_s = now
        sr.join_seg = len(self.seg_dt)
        sr.join_step = self.steps_done
        sr.finish_step = self.steps_done + max(1, sr.req.output_len - 1 - sr.decoded)
        self.kv_reserved += need
        self.peak_kv_reserved = max(self.peak_kv_reserved, self.kv_reserved)
        self._in_sum += sr.req.input_len + sr.decoded
        self._join_sum += self.steps_done
        self._joined += 1
        self.running[sr.req.request_id] = sr
        heapq.heappush(self._finish_heap, (sr.finish_step, sr.req.request_id))

    def _plan(self, now: float) -> None:
        self._seg_start = now
        self._work = self._next_prefill()
        self._stall = False
        if self._work:
            self.busy = True
            self._dt = self._prefill_step_s(self._work)
            self._schedule(now + self._dt, 1)
        elif self.running:
            self._make_room(now)
            self.busy = True
            joins = self._joined if self.config.remote_kv else 0
            self._dt = step_s(self.cost, self.rules, self._decode_work(joins))
            # a join makes its step longer than the next ones: that step is a segment alone
            k = 1 if joins and self.cost.decode_join_s else self._decode_steps()
            self._schedule(now + k * self._dt, k)
        else:
            self.busy = False
            self._version += 1
        self._joined = 0

    def _decode_steps(self) -> int:
        """Decode steps until the batch next changes by itself (the first finish)."""
        return self._finish_heap[0][0] - self.steps_done

    def _decode_work(self, joins: int = 0) -> StepWork:
        """The work of one decode-only step of the running batch."""
        longest = self._longest_context() if self.rules.graph_max_context else 0
        return StepWork(num_decodes=len(self.running), decode_context=self.context_tokens,
                        longest_context=longest, joins=joins)

    def _longest_context(self) -> int:
        """KV tokens of the longest running sequence (prompt and produced tokens)."""
        return max(s.req.input_len + s.decoded + self.steps_done - s.join_step
                   for s in self.running.values())

    # ---- prefill work and preemption (colocated baseline); overridden in colocated.py
    def _make_room(self, now: float) -> None:
        return None

    def _next_prefill(self) -> list[tuple[SimRequest, int]]:
        return []

    def _prefill_step_s(self, work: list[tuple[SimRequest, int]]) -> float:
        raise NotImplementedError

    def _finish_prefill(self, now: float) -> None:
        return None

    def check_integrity(self) -> None:
        assert self.kv_reserved == sum(
            s.req.input_len + s.req.output_len for s in self.running.values())
        assert len(self._finish_heap) == len(self.running)
        assert self.kv_reserved <= self.config.kv_capacity_tokens or len(self.running) == 1
