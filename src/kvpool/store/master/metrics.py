"""Prometheus metrics of the master: request counters and latencies, plus a collector that
reads the core's tables at scrape time (keys, bytes by segment and tier, evictions)."""

from __future__ import annotations

import threading
from collections import Counter, deque
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client import Counter as PromCounter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvpool.store.master.core import MasterCore
from kvpool.store.master.replay import JournalStats
from kvpool.store.master.views import MasterSnapshot, snapshot
from kvpool.store.wire.codes import ErrorCode

_LATENCY_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 1e-2, 0.1, 1.0)


def _code_name(status: int) -> str:
    try:
        return ErrorCode(status).name
    except ValueError:
        return str(status)


class _CoreCollector(Collector):
    def __init__(self, core: MasterCore, lock: threading.Lock) -> None:
        self.core = core
        self.lock = lock
        self.key_errors: Counter[tuple[str, str]] | None = None

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        with self.lock:
            snap = snapshot(self.core)
            key_errors = sorted((self.key_errors or {}).items())
            journal = self.core.journal.stats() if self.core.journal is not None else None
        per_key = CounterMetricFamily("kvpool_master_key_errors",
                                      "per-key outcomes other than OK", labels=["op", "code"])
        for (op, code), count in key_errors:
            per_key.add_metric([op, code], count)
        yield per_key
        yield from _table_families(snap)
        yield from _tier_families(snap)
        if journal is not None:
            yield from _journal_families(journal)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc)
    family.add_metric([], value)
    return family


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc)
    family.add_metric([], value)
    return family


def _journal_families(stats: JournalStats) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    yield _counter("kvpool_master_journal_write_failures",
                   "journal appends (their requests got RPC_FAIL) and fsyncs that failed",
                   stats.num_write_failures)
    yield _gauge("kvpool_master_journal_carried_records",
                 "records of failed journal writes waiting to be written",
                 stats.num_carried_records)
    report = stats.replay
    yield _gauge("kvpool_master_journal_replay_corrupt_runs",
                 "damaged runs the replay at start skipped", report.num_corrupt_runs)
    yield _gauge("kvpool_master_journal_replay_corrupt_bytes",
                 "bytes the replay at start skipped as corrupt", report.corrupt_bytes)
    yield _gauge("kvpool_master_journal_replay_torn_tail_bytes",
                 "bytes of a torn last record the replay at start dropped",
                 report.torn_tail_bytes)
    yield _gauge("kvpool_master_journal_replay_bad_records",
                 "intact records the replay at start could not apply", report.num_bad_records)


def _table_families(snap: MasterSnapshot) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    yield _gauge("kvpool_master_keys", "complete objects stored", snap.keys)
    yield _gauge("kvpool_master_pending_puts", "puts started, not ended", snap.pending)
    yield _gauge("kvpool_master_clients", "live clients", snap.clients)
    used = GaugeMetricFamily("kvpool_master_used_bytes", "allocated bytes",
                             labels=["segment", "tier"])
    cap = GaugeMetricFamily("kvpool_master_capacity_bytes", "mounted bytes",
                            labels=["segment", "tier"])
    for info in snap.segments:
        labels = [info.segment_id, info.tier.name]
        used.add_metric(labels, info.used_bytes)
        cap.add_metric(labels, info.capacity_bytes)
    yield used
    yield cap
    yield _counter("kvpool_master_evicted_objects", "objects evicted", snap.eviction.objects)
    yield _counter("kvpool_master_evicted_bytes", "bytes evicted", snap.eviction.bytes)
    yield _counter("kvpool_master_eviction_rounds", "eviction rounds", snap.eviction.rounds)
    yield _counter("kvpool_master_discarded_puts", "pending puts discarded after the timeout",
                   snap.stats.discarded_puts)
    yield _counter("kvpool_master_expired_clients", "clients declared dead",
                   snap.stats.expired_clients)
    yield _counter("kvpool_master_stalls_forgiven",
                   "own stalls longer than client_ttl/2 (deadlines moved)",
                   snap.stats.stalls_forgiven)
    yield _counter("kvpool_master_damaged_dropped",
                   "replicas dropped after a reader found bytes failing their checksum",
                   snap.stats.damaged_dropped)


_TIER_COUNTERS = (
    ("offloads", "objects copied from DRAM to a disk tier"),
    ("offload_failures", "offloads a node could not do"),
    ("loads", "objects copied from a disk tier into DRAM for a read"),
    ("load_failures", "loads a node could not do (a bad file among them)"),
    ("promotions", "loaded copies kept in DRAM after --ssd-promote-after reads"),
    ("copied_ahead", "DRAM objects copied to disk ahead of their eviction"),
    ("dram_dropped", "DRAM copies of objects already on disk freed by eviction"),
    ("disk_evicted_objects", "disk replicas dropped at the disk watermark"),
    ("disk_evicted_bytes", "bytes of disk replicas dropped at the disk watermark"),
    ("registered", "objects a restarted node registered from its disk"),
    ("register_refused", "files a restarted node offered that were refused"),
)


def _tier_families(snap: MasterSnapshot) -> list[GaugeMetricFamily | CounterMetricFamily]:
    out: list[GaugeMetricFamily | CounterMetricFamily] = [
        _counter(f"kvpool_master_ssd_{name}", doc, getattr(snap.tier, name))
        for name, doc in _TIER_COUNTERS]
    out += [_gauge("kvpool_master_ssd_disk_only_keys", "objects whose only copy is on disk",
                   snap.disk_only_keys),
            _gauge("kvpool_master_ssd_offloading_bytes", "bytes being copied to disk now",
                   snap.offloading_bytes),
            _gauge("kvpool_master_ssd_loading", "loads under way", snap.loading)]
    return out


class _Flush(Collector):
    """Registered first: a scrape folds the observations still queued into the counters
    before they are read."""

    def __init__(self, flush: Callable[[], None]) -> None:
        self.flush = flush

    def collect(self) -> Iterator[GaugeMetricFamily]:
        self.flush()
        return iter(())


class MasterMetrics:
    """Request counters and latencies. `observe` (on the RPC thread, once per request) only
    queues; the queue is folded into the Prometheus objects every FLUSH_EVERY requests and at
    each scrape (about 2 us per request less than updating them in place)."""

    FLUSH_EVERY = 512

    def __init__(self, core: MasterCore, lock: threading.Lock) -> None:
        self.registry = CollectorRegistry()
        self._queue: deque[tuple[str, int, float]] = deque()
        self.registry.register(_Flush(self.flush))
        self.ops = PromCounter("kvpool_master_ops", "RPC requests by op", ["op"],
                           registry=self.registry)
        self.errors = PromCounter("kvpool_master_errors", "RPC requests refused, by op and code",
                              ["op", "code"], registry=self.registry)
        self.latency = Histogram("kvpool_master_rpc_seconds", "time to handle one request",
                                 ["op"], buckets=_LATENCY_BUCKETS, registry=self.registry)
        self._collector = _CoreCollector(core, lock)
        self.registry.register(self._collector)
        self._children: dict[str, tuple[PromCounter, Histogram]] = {}

    def watch_key_errors(self, key_errors: Counter[tuple[str, str]]) -> None:
        self._collector.key_errors = key_errors

    def observe(self, op: str, status: int, seconds: float) -> None:
        queue = self._queue
        queue.append((op, status, seconds))
        if len(queue) >= self.FLUSH_EVERY:
            self.flush()

    def flush(self) -> None:
        """Fold the queued observations in (thread-safe: deque pops are atomic)."""
        queue, children = self._queue, self._children
        while True:
            try:
                op, status, seconds = queue.popleft()
            except IndexError:
                return
            pair = children.get(op)
            if pair is None:
                pair = children[op] = (self.ops.labels(op), self.latency.labels(op))
            pair[0].inc()
            pair[1].observe(seconds)
            if status != 0:
                self.errors.labels(op, _code_name(status)).inc()
