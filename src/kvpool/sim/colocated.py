"""The colocated vLLM-like baseline: every instance runs both prefill and decode.

Per instance (vLLM v0.5-style scheduling):
- without chunked prefill, a waiting prompt runs as a whole-prefill step before the next decode
  step, so every running request's next token is delayed by the whole prefill;
- with chunked prefill, each step carries the running decodes plus up to `chunk_tokens` prompt
  tokens (minus one per running sequence), so prefill slows every step a little instead;
- with prefix caching, the instance's own GPU cache of `prefix_cache_blocks` blocks (LRU) lets
  a prompt skip its cached leading blocks. There is no cache sharing between instances.
Requests are dispatched round-robin (or to the instance with the fewest outstanding requests);
there is no admission control: every request is served, however late.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from tqdm import tqdm

from kvpool.conductor.cost import CostModel
from kvpool.errors import ConfigError
from kvpool.sim.cache import BlockCache
from kvpool.sim.engine import BatchEngine, EngineConfig, Hook
from kvpool.sim.events import EventLoop
from kvpool.sim.metrics import SimResult
from kvpool.sim.record import SimRequest
from kvpool.sim.trace import TraceRequest

DISPATCH = ("round_robin", "least_loaded")


@dataclass(frozen=True, slots=True)
class ColocatedConfig:
    num_instances: int = 16
    engine: EngineConfig = field(default_factory=EngineConfig)
    dispatch: str = "round_robin"
    block_size: int = 512

    def __post_init__(self) -> None:
        if self.num_instances <= 0:
            raise ConfigError(f"num_instances must be > 0, got {self.num_instances}")
        if self.dispatch not in DISPATCH:
            raise ConfigError(f"dispatch must be one of {DISPATCH}, got {self.dispatch!r}")


class ColocatedEngine(BatchEngine):
    def __init__(self, engine_id: int, cost: CostModel, config: EngineConfig, loop: EventLoop,
                 on_finish: Hook, block_size: int) -> None:
        super().__init__(engine_id, cost, config, loop, on_finish)
        self.block_size = block_size
        self.cache = (BlockCache(config.prefix_cache_blocks, "lru")
                      if config.prefix_cache_blocks else None)
        self._current: SimRequest | None = None

    def _next_prefill(self) -> tuple[SimRequest, int] | None:
        sr = self._current or self._start_prompt()
        if sr is None:
            return None
        self._current = sr
        left = sr.req.input_len - sr.prefilled_tokens
        if not self.config.chunk_tokens:
            return sr, left
        return sr, min(left, max(1, self.config.chunk_tokens - len(self.running)))

    def _start_prompt(self) -> SimRequest | None:
        if not self.prefill_queue:
            return None
        sr = self.prefill_queue[0]
        need = sr.req.input_len + sr.req.output_len
        if self.running and self.kv_reserved + need > self.config.kv_capacity_tokens:
            return None
        self.prefill_queue.popleft()
        blocks = self.cache.prefix_blocks(sr.req.block_hashes) if self.cache else 0
        sr.prefix_len = min(blocks * self.block_size, sr.req.input_len)
        sr.prefilled_tokens = sr.reused_tokens = sr.prefix_len
        return sr

    def _prefill_step_s(self, sr: SimRequest, tokens: int) -> float:
        start = sr.prefilled_tokens
        compute = self.cost.prefill_s(start + tokens, start)
        if start != sr.prefix_len:
            compute -= self.cost.prefill_base_s  # the fixed cost is paid once per prompt
        sr.prefill_gpu_s += compute
        if not self.config.chunk_tokens:
            self._stall = True
            return compute
        if not self.running:
            return compute
        return compute + self.cost.decode_step_s(len(self.running), self.context_tokens)

    def _finish_chunk(self, now: float) -> None:
        if self._chunk is None:
            return
        sr, tokens = self._chunk
        sr.prefilled_tokens += tokens
        if sr.prefilled_tokens < sr.req.input_len:
            return
        self._current = None
        sr.first_token_s = now
        if self.cache is not None:
            self.cache.access(sr.req.block_hashes)
        if sr.req.output_len <= 1:
            sr.finish_s = now
            self.on_finish(sr, now)
        else:
            self.waiting.append(sr)


class ColocatedSim:
    def __init__(self, cost: CostModel, config: ColocatedConfig | None = None,
                 ttft_slo_s: float = 30.0, tbt_slo_s: float = 0.1) -> None:
        self.cost = cost
        self.config = cfg = config or ColocatedConfig()
        self.ttft_slo_s, self.tbt_slo_s = ttft_slo_s, tbt_slo_s
        self.loop = EventLoop()
        self.instances = [ColocatedEngine(i, cost, cfg.engine, self.loop, self._finished,
                                          cfg.block_size) for i in range(cfg.num_instances)]
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

    def _finished(self, sr: SimRequest, now: float) -> None:
        return None
