"""The proxy's Prometheus metrics, on a registry of its own (several proxies may live in one
test process). Worker gauges are read from the live cluster at scrape time, and the cost
model's terms (and, once fitted, the fit's residual) from the model in use. What is counted
per chunk of a stream (TBT, output tokens) goes to `LoopHistogram` and `LoopCounter`: plain
numbers updated from the event loop alone (prometheus_client's take a lock per update)."""

from __future__ import annotations

import json
from bisect import bisect_left
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from kvpool import busypoll
from kvpool.conductor.cost import CostModel
from kvpool.conductor.measured import MeasuredCostModel
from kvpool.gc_pauses import GcPauses

if TYPE_CHECKING:
    from kvpool.loop_poll import LoopPoller
    from kvpool.serve.backend import EngineBackend
    from kvpool.serve.cluster import LiveCluster
    from kvpool.serve.token_cache import PieceCache

_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_TBT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class ProxyMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvpool_proxy_requests", "Requests answered, by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.ttft = Histogram("kvpool_proxy_ttft_seconds", "Time to first token", registry=r,
                              buckets=_TTFT_BUCKETS)
        self.tbt = LoopHistogram("kvpool_proxy_tbt_seconds", "Time between output tokens",
                                 _TBT_BUCKETS)
        r.register(self.tbt)
        self.decision = Histogram("kvpool_proxy_decision_seconds",
                                  "Time the conductor took to schedule a request", registry=r,
                                  buckets=(1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3,
                                           1e-2, 3e-2, 0.1))
        self.prompt_tokens = Counter("kvpool_proxy_prompt_tokens", "Prompt tokens prefilled",
                                     registry=r)
        self.prefix_hit_tokens = Counter(
            "kvpool_proxy_prefix_hit_tokens",
            "Prompt tokens whose KV was reused from a worker's cache or the pool", registry=r)
        self.output_tokens = LoopCounter("kvpool_proxy_output_tokens", "Tokens generated")
        r.register(self.output_tokens)
        self.read_relay_frames = LoopCounter(
            "kvpool_proxy_read_relay_frames",
            "Frames of streams taken in the worker connection's read callback (the others "
            "went through the proxy's generators)")
        r.register(self.read_relay_frames)
        self.migrations = Counter("kvpool_proxy_migrations",
                                  "Requests resumed on another worker after theirs failed, by "
                                  "the leg that failed", ["leg"], registry=r)
        self.handoff_wait = Histogram(
            "kvpool_proxy_pd_handoff_wait_seconds",
            "vllm backend, P/D through a store connector: how long a decode leg waited for "
            "its prompt's blocks to land in the pool", registry=r,
            buckets=(1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0, 10.0))
        self.direct = Counter("kvpool_proxy_direct_requests",
                              "Requests sent straight to a decode worker, their uncached part "
                              "being short (conditional disaggregation)", registry=r)
        self.rejections = Counter("kvpool_proxy_rejections", "Requests refused by admission",
                                  ["reason", "stage"], registry=r)
        self.cost_refits = Counter("kvpool_proxy_cost_refits",
                                   "Times the prefill cost was learned again (--fit-cost)",
                                   registry=r)
        r.register(_GcPauseCollector(GcPauses.installed()))

    def watch(self, cluster: LiveCluster, restart_counts: str | None = None,
              backend: EngineBackend | None = None) -> None:
        self.registry.register(_WorkerCollector(cluster))
        if restart_counts is not None:
            self.registry.register(_RestartCollector(restart_counts))
        if backend is not None:
            self.registry.register(_EngineCollector(backend))

    def watch_cost(self, in_use: Callable[[], tuple[CostModel, str]]) -> None:
        """Export the cost model `in_use()` returns (the model, its source) at each scrape."""
        self.registry.register(_CostCollector(in_use))

    def watch_tokenizer(self, cache: PieceCache) -> None:
        """Export what the tokenizer's cache of prompt pieces found and kept, at each
        scrape."""
        self.registry.register(_TokenCacheCollector(cache))

    def watch_loop_poll(self, poller: LoopPoller) -> None:
        """Export the event loop's polling (kvpool.loop_poll) at each scrape."""
        self.registry.register(_LoopPollCollector(poller))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class LoopHistogram(Collector):
    """A histogram observed from the event loop only (no lock): counts per bucket (a value
    goes in the first whose bound is >= it, as prometheus_client's) and the sum."""

    def __init__(self, name: str, doc: str, buckets: tuple[float, ...]) -> None:
        self.name, self.doc = name, doc
        self.bounds = (*buckets, float("inf"))
        self.counts = [0] * len(self.bounds)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def collect(self) -> Iterator[HistogramMetricFamily]:
        yield HistogramMetricFamily(self.name, self.doc, buckets=cumulative(self.bounds,
                                                                            self.counts),
                                    sum_value=self.sum)


def cumulative(bounds: tuple[float, ...], counts: list[int]) -> list[tuple[str, float]]:
    """A histogram's buckets as Prometheus has them: (`le`, count up to that bound)."""
    out: list[tuple[str, float]] = []
    total = 0
    for bound, count in zip(bounds, counts, strict=True):
        total += count
        out.append((floatToGoString(bound), total))
    return out


class LoopCounter(Collector):
    """A counter incremented from the event loop only (no lock)."""

    def __init__(self, name: str, doc: str) -> None:
        self.name, self.doc, self.value = name, doc, 0

    def inc(self, amount: int = 1) -> None:
        self.value += amount

    def collect(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily(self.name, self.doc, value=self.value)


class _GcPauseCollector(Collector):
    def __init__(self, pauses: GcPauses) -> None:
        self.pauses = pauses

    def collect(self) -> Iterator[HistogramMetricFamily]:
        p = self.pauses
        fam = HistogramMetricFamily(
            "kvpool_proxy_gc_pause_seconds", "Runs of Python's cyclic garbage collector in "
            "the proxy's process, by generation: each holds every stream in flight",
            labels=["generation"])
        for gen, counts in enumerate(p.counts):
            fam.add_metric([str(gen)], cumulative(p.bounds, counts), p.sums[gen])
        yield fam


class _WorkerCollector(Collector):
    def __init__(self, cluster: LiveCluster) -> None:
        self.cluster = cluster

    def collect(self) -> Iterator[GaugeMetricFamily]:
        labels = ["worker", "role"]
        fams = {name: GaugeMetricFamily(f"kvpool_proxy_worker_{name}", doc, labels=labels)
                for name, doc in (
                    ("up", "1 while the worker is in rotation"),
                    ("waiting", "Requests waiting on the worker (its /load)"),
                    ("running", "Requests running on the worker (its /load)"),
                    ("free_kv_tokens", "Free KV cache tokens (its /load)"),
                    ("cached_blocks", "Full blocks in the worker's cache, indexed for prefix match"),
                    ("queue_seconds", "Conductor's predicted prefill queue time"),
                    ("assigned", "Requests the conductor has assigned to this decode worker"))}
        now = self.cluster.clock_now()
        for w in self.cluster.workers.values():
            lv = [w.url, w.role]
            fams["up"].add_metric(lv, 1.0 if w.alive else 0.0)
            fams["waiting"].add_metric(lv, w.load.num_waiting)
            fams["running"].add_metric(lv, w.load.num_running)
            fams["free_kv_tokens"].add_metric(lv, w.load.free_kv_tokens)
            fams["cached_blocks"].add_metric(lv, len(w.blocks))
            if w.prefill_load is not None:
                fams["queue_seconds"].add_metric(lv, w.prefill_load.queue_s(now))
            if w.decode_load is not None:
                fams["assigned"].add_metric(lv, w.decode_load.num_assigned)
        yield from fams.values()


class _TokenCacheCollector(Collector):
    def __init__(self, cache: PieceCache) -> None:
        self.cache = cache

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        c = self.cache
        tokens = CounterMetricFamily(
            "kvpool_proxy_tokenizer_cache_tokens", "Prompt tokens (between special tokens) "
            "looked up in the tokenizer's cache: found, or encoded", labels=["result"])
        tokens.add_metric(["hit"], c.hit_tokens)
        tokens.add_metric(["miss"], c.miss_tokens)
        yield tokens
        yield CounterMetricFamily("kvpool_proxy_tokenizer_cache_evictions",
                                  "Pieces the tokenizer's cache let go for room", value=c.evicted)
        yield GaugeMetricFamily("kvpool_proxy_tokenizer_cache_bytes",
                                "About what the tokenizer's cached pieces take", value=c.size_bytes)


class _LoopPollCollector(Collector):
    def __init__(self, poller: LoopPoller) -> None:
        self.poller = poller

    def collect(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily(
            "kvpool_proxy_loop_poll_stretches", "Stretches the event loop polled instead of "
            "sleeping (--loop-poll-us)", value=self.poller.stretches)
        yield CounterMetricFamily(
            "kvpool_proxy_loop_poll_pauses", "Times polling stood aside for a crowded machine",
            value=busypoll.CROWD.pauses)


class _CostCollector(Collector):
    def __init__(self, in_use: Callable[[], tuple[CostModel, str]]) -> None:
        self.in_use = in_use

    def collect(self) -> Iterator[GaugeMetricFamily]:
        cost, source = self.in_use()
        terms = GaugeMetricFamily(
            "kvpool_proxy_cost_prefill_term", "The prefill cost model's terms: base (s), "
            "linear (s per new token), quadratic (s per token pair); model: fitted, cost_file "
            "or default", labels=["term", "model"])
        for term, value in (("base", cost.prefill_base_s), ("linear", cost.prefill_linear_s),
                            ("quadratic", cost.prefill_quadratic_s)):
            terms.add_metric([term, source], value)
        yield terms
        if not isinstance(cost, MeasuredCostModel) or cost.fit is None:
            return
        fit = cost.fit
        for name, doc, value in (
                ("fit_residual_seconds", "Recency-weighted RMS residual of the samples the "
                 "prefill cost was fitted to", fit.residual_s),
                ("fit_samples", "Prefill samples the cost was fitted to", fit.num_samples),
                ("fit_outliers", "Of those, samples left out as outliers", fit.num_outliers),
                ("longest_context_tokens", "Longest measured context (n + p): the fitted "
                 "attention term is linear beyond it", cost.longest_context)):
            yield GaugeMetricFamily(f"kvpool_proxy_cost_{name}", doc, value=value)


class _RestartCollector(Collector):
    """Restarts per process as the cluster's supervisor (`kvpool up`) counts them, read at
    scrape time from the JSON file it replaces whole ({process: restarts}); nothing while the
    file is absent or not such an object."""

    def __init__(self, path: str) -> None:
        self.path = path

    def collect(self) -> Iterator[CounterMetricFamily]:
        fam = CounterMetricFamily("kvpool_up_restarts", "Processes of the cluster that exited "
                                  "and were started again by kvpool up", labels=["process"])
        try:
            with open(self.path) as fh:
                counts = json.load(fh)
        except (OSError, ValueError):
            counts = {}
        for name, n in (counts.items() if isinstance(counts, dict) else ()):
            if isinstance(n, int):
                fam.add_metric([str(name)], n)
        yield fam


class _EngineCollector(Collector):
    """The backend's own gauges (EngineBackend.engine_gauges), e.g. the vllm backend's KV
    events: blocks indexed and whether an instance's events never match a computed hash."""

    def __init__(self, backend: EngineBackend) -> None:
        self.backend = backend

    def collect(self) -> Iterator[GaugeMetricFamily]:
        for name, values in sorted(self.backend.engine_gauges().items()):
            fam = GaugeMetricFamily(f"kvpool_proxy_engine_{name}",
                                    f"{self.backend.name} engines: {name}", labels=["worker"])
            for url, value in sorted(values.items()):
                fam.add_metric([url], value)
            yield fam
