"""Discrete-event simulation of the disaggregated (Mooncake) cluster.

Life of a request: arrival -> conductor decision (or rejection) -> prefill queue of the chosen
instance (fetching a remote prefix first when the decision says so) -> first token -> KV streamed
to the decode instance layer by layer -> decode-stage check (baseline admission only) ->
continuous batching -> finish. Each prefill instance's DRAM is a BlockCache whose contents are
mirrored into the conductor's PrefixIndex.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from tqdm import tqdm

from kvpool.conductor import Accepted, ClusterView, Conductor, Rejected
from kvpool.errors import ConfigError
from kvpool.sim.cache import BlockCache
from kvpool.sim.engine import BatchEngine, EngineConfig
from kvpool.sim.events import EventLoop
from kvpool.sim.metrics import LoadSample, SimResult
from kvpool.sim.record import SimRequest
from kvpool.sim.trace import TraceRequest

DRAM_TOKENS_PER_NODE = 3_000_000
"""[F] 5.3: about 1 TB of DRAM per node holds about 3M tokens of KV."""


@dataclass(frozen=True, slots=True)
class DisaggConfig:
    num_prefill: int = 8
    num_decode: int = 8
    cache_blocks_per_instance: int | None = DRAM_TOKENS_PER_NODE // 512
    """Each prefill node's DRAM share of the pool, in 512-token blocks (None = unlimited)."""
    eviction: str = "lru"
    engine: EngineConfig = field(default_factory=EngineConfig)
    sample_every_s: float = 30.0
    """Period of the load-over-time samples."""
    prefill_noise: float = 0.0
    """Prediction error: each prefill's real compute time is the predicted one times a
    lognormal factor with this sigma (mean 1). 0 = the conductor predicts exactly."""
    seed: int = 0
    """Seed of the prediction-error draws."""

    def __post_init__(self) -> None:
        if self.num_prefill <= 0 or self.num_decode <= 0:
            raise ConfigError(
                f"need >= 1 prefill and decode instance, got {self.num_prefill}P{self.num_decode}D")
        if self.sample_every_s <= 0:
            raise ConfigError(f"sample_every_s must be > 0, got {self.sample_every_s}")
        if not 0 <= self.prefill_noise <= 2:
            raise ConfigError(f"prefill_noise must be in [0, 2], got {self.prefill_noise}")


class DisaggSim:
    def __init__(self, conductor: Conductor, config: DisaggConfig | None = None) -> None:
        self.conductor = conductor
        self.config = cfg = config or DisaggConfig()
        self.cost = conductor.cost
        self.loop = EventLoop()
        self.view = ClusterView.create(cfg.num_prefill, cfg.num_decode,
                                       cfg.engine.kv_capacity_tokens)
        self.caches = [self._make_cache(i) for i in range(cfg.num_prefill)]
        decode = replace(cfg.engine, remote_kv=True)
        self.decoders = [BatchEngine(i, self.cost, decode, self.loop, self._finished)
                         for i in range(cfg.num_decode)]
        self.load: list[LoadSample] = []
        self._rng = random.Random(cfg.seed)
        self._free_at = [0.0] * cfg.num_prefill
        """When each prefill instance really finishes its queued work."""
        self._shift = [0.0] * cfg.num_prefill
        """Total correction applied so far to each instance's predicted queue end."""

    def _make_cache(self, inst: int) -> BlockCache:
        index = self.view.index
        return BlockCache(self.config.cache_blocks_per_instance, self.config.eviction,
                          on_insert=lambda b: index.add(inst, b),
                          on_evict=lambda b: index.remove(inst, b))

    def run(self, requests: Sequence[TraceRequest], progress: bool = False) -> SimResult:
        records = [SimRequest(r) for r in requests]
        bar = tqdm(total=len(records), disable=not progress, desc="simulating", unit="req")
        if records:
            self.loop.at(records[0].req.arrival_s, self._arrive, records, 0, bar)
            self.loop.at(0.0, self._sample, records[-1].req.arrival_s)
        self.loop.run()
        bar.close()
        cfg = self.conductor.config
        return SimResult(records, cfg.ttft_slo_s, cfg.tbt_slo_s, self.load, self.loop.num_events)

    def _arrive(self, records: list[SimRequest], i: int, bar: tqdm) -> None:
        if i + 1 < len(records):
            self.loop.at(records[i + 1].req.arrival_s, self._arrive, records, i + 1, bar)
        bar.update(1)
        sr, now = records[i], self.loop.now
        info = sr.req.info()
        decision = self.conductor.schedule(info, self.view, now)
        if isinstance(decision, Rejected):
            sr.rejected_stage, sr.rejected_reason = "arrival", decision.reason
            return
        self.view.record_accept(info, decision, now)
        choice = decision.prefill
        if choice.source_id is not None:
            blocks = -(-choice.prefix_len // self.conductor.config.block_size)
            self.caches[choice.source_id].access(info.block_hashes[:blocks])
        p = choice.instance_id
        sr.prefill_gpu_s = choice.prefill_s * self._error_factor()
        sr.reused_tokens, sr.transfer_s = choice.prefix_len, choice.wait_s + choice.transfer_s
        start = max(now, self._free_at[p])
        self._free_at[p] = end = start + sr.transfer_s + sr.prefill_gpu_s
        predicted_end = self.view.prefill[p].busy_until_s
        self.loop.at(end, self._prefill_done, sr, decision, predicted_end, self._shift[p])

    def _error_factor(self) -> float:
        sigma = self.config.prefill_noise
        return self._rng.lognormvariate(-sigma * sigma / 2, sigma) if sigma else 1.0

    def _prefill_done(self, sr: SimRequest, decision: Accepted, predicted_end: float,
                      shift_then: float) -> None:
        now, p, d = self.loop.now, decision.prefill.instance_id, decision.decode.instance_id
        self.view.record_prefill_done(p)
        # the queue behind this request now starts later (or earlier) than predicted
        delta = now - (predicted_end + self._shift[p] - shift_then)
        self.view.prefill[p].busy_until_s += delta
        self._shift[p] += delta
        self.caches[p].access(sr.req.block_hashes)
        sr.first_token_s = now
        if sr.req.output_len <= 1:
            sr.finish_s = now
            self.view.record_decode_end(d, sr.req.info(), started=False)
            return
        exec_start = now - sr.prefill_gpu_s
        arrive = max(now, exec_start + self.cost.kv_transfer_s(sr.req.input_len))
        self.loop.at(arrive, self._kv_arrived, sr, d)

    def _kv_arrived(self, sr: SimRequest, d: int) -> None:
        info, load = sr.req.info(), self.view.decode[d]
        verdict = self.conductor.admission.at_decode(info, load, load.num_active,
                                                     load.active_tokens)
        if verdict is not None:
            sr.rejected_stage, sr.rejected_reason = "decode", verdict.reason
            self.view.record_decode_end(d, info, started=False)
            return
        self.view.record_decode_start(d, info, self.loop.now)
        self.decoders[d].submit_decode(sr, self.loop.now)

    def _finished(self, sr: SimRequest, now: float) -> None:
        self.view.record_decode_end(sr.engine_id, sr.req.info(), started=True)

    def check_integrity(self) -> None:
        """Every cache is within capacity and mirrored exactly by the conductor's index."""
        held: dict[int, set[int]] = {}
        for inst, cache in enumerate(self.caches):
            cache.check_integrity()
            for block in cache.blocks():
                held.setdefault(block, set()).add(inst)
        assert len(held) == len(self.view.index)
        for block, insts in held.items():
            assert self.view.index.holders(block) == insts, block
        for engine in self.decoders:
            engine.check_integrity()

    def _sample(self, until: float) -> None:
        now, cfg = self.loop.now, self.conductor.config
        p_load = sum(p.queue_s(now) for p in self.view.prefill) / len(self.view.prefill)
        d_load = sum(self.cost.decode_step_s(e.batch_size, e.context_tokens)
                     for e in self.decoders) / len(self.decoders)
        self.load.append(LoadSample(now, p_load / cfg.ttft_slo_s, d_load / cfg.tbt_slo_s))
        if now + self.config.sample_every_s <= until:
            self.loop.at(now + self.config.sample_every_s, self._sample, until)
