"""From prompt ids to a booked run: ask the conductor, book the decision on the live cluster,
learn the prefill cost from what runs measure, abort what runs leave behind; the run itself
(its legs on the workers) is serve/run.py.

    schedule(prompt ids)  -> Booking            (ApiError 429 on Rejected, 503 without workers)
    Run(dispatcher, booking, ...)               (serve/run.py) drives the booked request
"""

from __future__ import annotations

import asyncio
import itertools
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import replace

from kvpool.clock import Clock
from kvpool.conductor import (
    Accepted,
    Conductor,
    ConductorConfig,
    CostModel,
    Rejected,
    RequestInfo,
)
from kvpool.conductor.measured import MeasuredCostModel, cost_note, learn_prefill
from kvpool.serve.backend import EngineBackend
from kvpool.serve.cluster import Booking, LiveCluster
from kvpool.serve.config import ProxyConfig
from kvpool.serve.errors import no_workers, rejected, slo_unreachable
from kvpool.serve.metrics import ProxyMetrics
from kvpool.serve.samples import MeasuredSamples

REFIT_EVERY = 8
"""Prefill samples between two refits of the cost model (with --fit-cost)."""


class Dispatcher:
    def __init__(self, config: ProxyConfig, cluster: LiveCluster, client: EngineBackend,
                 cost: CostModel, clock: Clock, metrics: ProxyMetrics) -> None:
        self.config = config
        self.cluster = cluster
        self.client = client
        self.clock = clock
        self.metrics = metrics
        self.cost = cost
        self.conductor_config = ConductorConfig(
            prefill_policy=config.prefill_policy, admission=config.admission,
            ttft_slo_s=config.ttft_slo_s, tbt_slo_s=config.tbt_slo_s,
            ttft_slo_relative=config.ttft_slo_relative,
            decode_horizon_s=config.decode_horizon_s)
        self.conductor = Conductor(self.conductor_config, cost, clock)  # checks the names now
        self._ids = itertools.count(1)
        self._background: set[asyncio.Task[None]] = set()
        self._samples: deque[tuple[int, int, float]] = deque(maxlen=256)
        self._new_samples = 0
        self.measured = MeasuredSamples()

    def _conductor_for(self, block_size: int) -> Conductor:
        if self.conductor.config.block_size != block_size:
            self.conductor = Conductor(replace(self.conductor_config, block_size=block_size),
                                       self.cost, self.clock)
        return self.conductor

    def schedule(self, prompt_ids: Sequence[int], max_tokens: int,
                 cache_salt: str | None = None) -> Booking:
        ref = self.cluster.reference
        view = self.cluster.view
        if ref is None or not view.prefill or not view.decode:
            raise no_workers(f"no worker in rotation (prefill: {len(view.prefill)}, "
                             f"decode: {len(view.decode)}); retry when workers are up")
        hashes = self.client.block_hashes(prompt_ids, cache_salt, ref)
        req = RequestInfo(next(self._ids), len(prompt_ids), max_tokens, tuple(hashes))
        now = self.clock.now()
        prefixes = self.client.prefixes(self.cluster.prefill_urls)
        decision = self._conductor_for(ref.block_size).schedule(req, view, now, prefixes)
        if isinstance(decision, Rejected):
            self.metrics.rejections.labels(decision.reason, decision.stage).inc()
            note = "" if decision.reason != "ttft" else cost_note(
                self.cost, self.cost_source, req.input_len, decision.prefix_len)
            if decision.reason == "ttft" and decision.unloaded_ttft_s > decision.ttft_limit_s:
                raise slo_unreachable(decision.unloaded_ttft_s, decision.ttft_limit_s, note)
            raise rejected(decision.reason, decision.predicted_ttft_s, decision.predicted_tbt_s,
                           self._retry_after_s(decision), note)
        direct = self._direct(req, decision)
        if direct:  # its prefill instance does no work for it (booked with none; its end
            # at the first token shifts no queue there)
            decision = Accepted(replace(decision.prefill, transfer_s=0.0, prefill_s=0.0,
                                        wait_s=0.0),
                                decision.decode)
            self.metrics.direct.inc()
        booking = self.cluster.book(req, decision, now)
        booking.direct = direct
        if prefixes is not None:
            prefixes.routed(decision.prefill.instance_id, hashes)
        return booking

    def _direct(self, req: RequestInfo, decision: Accepted) -> bool:
        """Conditional disaggregation: the uncached part is short enough for the decode worker
        to compute (config.direct_below_tokens), and the decision is not colocated already."""
        limit = self.config.direct_below_tokens
        if limit <= 0:
            return False
        uncached = req.input_len - decision.prefill.prefix_len
        return uncached <= limit and not self.cluster.is_colocated(decision)

    def check_decode(self, b: Booking) -> None:
        """The decode stage's own check when the KV is ready (only the `none` baseline has one):
        ApiError 429 after the prefill was spent, as the simulator counts it."""
        d = b.decode_load
        verdict = self.conductor.admission.at_decode(b.req, d, d.num_active, d.active_tokens)
        if verdict is not None:
            self.metrics.rejections.labels(verdict.reason, verdict.stage).inc()
            raise rejected(verdict.reason, verdict.predicted_ttft_s, verdict.predicted_tbt_s, 1)

    def _retry_after_s(self, r: Rejected) -> int:
        if r.reason == "ttft":
            return max(1, min(60, math.ceil(r.predicted_ttft_s - r.ttft_limit_s)))
        return 1

    @property
    def cost_source(self) -> str:
        """Where the cost model in use comes from: fitted (--fit-cost), cost_file (--cost) or
        default (the papers' 70B figures)."""
        if isinstance(self.cost, MeasuredCostModel):
            return "fitted"
        return "cost_file" if self.config.cost_path else "default"

    def cost_in_use(self) -> tuple[CostModel, str]:
        return self.cost, self.cost_source

    def learn(self, booking: Booking, prefix_len: int, prefill_s: float) -> None:
        """With fit_cost: one measured prefill; every REFIT_EVERY samples the conductor's
        prefill cost is learned again from the last 256 (conductor/measured.py: a bounded,
        recency-weighted, robust non-negative fit kept within what was measured; samples with
        other work queued are skipped: their time includes that work). Every measured prefill
        is kept in `measured`."""
        if prefill_s > 0:
            self.measured.add_prefill(booking.req.input_len, prefix_len, prefill_s, booking.alone)
        if not self.config.fit_cost or not booking.alone or prefill_s <= 0:
            return
        self._samples.append((booking.req.input_len, prefix_len, prefill_s))
        self._new_samples += 1
        lengths = {n - p for n, p, _ in self._samples}
        if self._new_samples < REFIT_EVERY or len(lengths) < 3:
            return
        self._new_samples = 0
        self.cost = learn_prefill(self._samples, self.cost)
        self.metrics.cost_refits.inc()
        self.cluster.cost = self.cost
        self.conductor = Conductor(self.conductor.config, self.cost, self.clock)

    def abort_later(self, url: str, request_id: str) -> None:
        task = asyncio.get_running_loop().create_task(self.client.abort(url, request_id))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
