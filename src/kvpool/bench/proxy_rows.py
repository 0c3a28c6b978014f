"""The figures of `kvpool bench proxy`: what each relay's runs add up to (`Tally`), the rows
printed from them, and their comparisons (kvpool over nginx; every relay's latency over the
client asking the worker straight). Pure: no processes, no sockets.

    row (one per relay, load, concurrency): req/s, tokens/s, the relay's CPU per token and per
    request and requests per relay-CPU second, the worker's CPU per token, latency p50/p99,
    added latency p50/p99 over `direct`, the conductor's decision time p50/p99 (from the
    proxy's kvpool_proxy_decision_seconds histogram), the share of its streams' chunks after
    the first taken in the read callback (`read_relay_share`), the proxy's time in its
    garbage collector per request (`relay_gc_us_per_request`, from its
    kvpool_proxy_gc_pause_seconds), and `ratio_*` over nginx.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from kvpool.bench.http_load import Load
from kvpool.bench.proc_cpu import per_unit
from kvpool.bench.trace_prompts import pct

DIRECT = "direct"
"""The relay name of the client asking the worker straight (no relay: the latency anchor)."""
DECISION_METRIC = "kvpool_proxy_decision_seconds"
CHUNKS_METRIC = "kvpool_proxy_tbt_seconds_count"
"""The chunks of streams after their first (one TBT observation each)."""
RELAYED_METRIC = "kvpool_proxy_read_relay_frames_total"
"""Of those, the frames taken in the worker connection's read callback."""
GC_METRIC = "kvpool_proxy_gc_pause_seconds_sum"
"""Seconds the proxy's process spent in its garbage collector (a sample per generation)."""

Buckets = dict[float, float]
"""A Prometheus histogram's cumulative counts by upper bound (`le`; inf included)."""


@dataclass
class Scrape:
    """What a proxy's /metrics says (a reading, or what it counted between two)."""

    decisions: Buckets
    chunks: float = 0.0
    relayed: float = 0.0
    gc_s: float | None = None
    """In the garbage collector (None: a proxy that does not say, an older one)."""

    def delta(self, after: Scrape) -> Scrape:
        gc_s = None if self.gc_s is None or after.gc_s is None else after.gc_s - self.gc_s
        return Scrape(bucket_delta(self.decisions, after.decisions),
                      after.chunks - self.chunks, after.relayed - self.relayed, gc_s)


@dataclass
class Tally:
    """One relay's runs of one load at one concurrency, summed over the rounds."""

    requests: int = 0
    tokens: int = 0
    wall_s: float = 0.0
    relay_cpu_s: float = 0.0
    worker_cpu_s: float = 0.0
    engine_cpu_s: float = 0.0
    """Of worker_cpu_s, the workers' engine threads' (the step a GPU would take over)."""
    relay_writes: int = 0
    """The relay processes' write calls (`proc_cpu.WriteMeter`): its writes to the client
    and the worker."""
    latencies_s: list[float] = field(default_factory=list)
    decisions: Buckets | None = None
    """The decision histogram's counts over these runs (None: not read for this relay)."""
    chunks: float = 0.0
    relayed: float = 0.0
    """Chunks of streams after their first, and of those the frames relayed in the read
    callback (from /metrics, where it is read)."""
    gc_s: float | None = None
    """The proxy's time in its garbage collector (from /metrics, where it says)."""

    def add(self, load: Load, relay_cpu_s: float, worker_cpu_s: float,
            scrape: Scrape | None = None, engine_cpu_s: float = 0.0,
            relay_writes: int = 0) -> None:
        self.engine_cpu_s += engine_cpu_s
        self.relay_writes += relay_writes
        self.requests += load.requests
        self.tokens += load.units
        self.wall_s += load.wall_s
        self.relay_cpu_s += relay_cpu_s
        self.worker_cpu_s += worker_cpu_s
        self.latencies_s += load.latencies_s
        if scrape is not None:
            self.decisions = add_buckets(self.decisions or {}, scrape.decisions)
            self.chunks += scrape.chunks
            self.relayed += scrape.relayed
            if scrape.gc_s is not None:
                self.gc_s = (self.gc_s or 0.0) + scrape.gc_s


def add_buckets(a: Buckets, b: Buckets) -> Buckets:
    return {le: a.get(le, 0.0) + b.get(le, 0.0) for le in set(a) | set(b)}


def bucket_delta(before: Buckets, after: Buckets) -> Buckets:
    """What a histogram counted between two readings."""
    return {le: after[le] - before.get(le, 0.0) for le in after}


def histogram_quantile(buckets: Buckets, q: float) -> float | None:
    """The q-quantile (0..1) of a histogram's cumulative bucket counts, interpolated linearly
    inside the bucket it falls in, as Prometheus's histogram_quantile does (the first bucket
    from 0; the +Inf bucket answers its lower bound). None when it counted nothing."""
    bounds = sorted(buckets)
    total = buckets[bounds[-1]] if bounds else 0.0
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for le in bounds:
        count = buckets[le]
        if count >= rank:
            if le == float("inf"):
                return lower
            inside = count - below
            return lower + (le - lower) * ((rank - below) / inside if inside > 0 else 1.0)
        lower, below = le, count
    return lower


def rows(tallies: dict[tuple[str, str, int], Tally],
         settings: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (relay, load, concurrency), with `settings` (speed-up, interval, engines)
    in each; then the comparisons."""
    out = []
    for (name, load, concurrency), t in tallies.items():
        row: dict[str, Any] = {
            "bench": "proxy", "relay": name, "load": load, "concurrency": concurrency,
            **settings, "requests": t.requests, "tokens": t.tokens,
            "wall_s": round(t.wall_s, 3),
            "req_per_s": round(t.requests / t.wall_s, 1) if t.wall_s else 0.0,
            "tokens_per_s": round(t.tokens / t.wall_s, 1) if t.wall_s else 0.0,
            "relay_cpu_s": round(t.relay_cpu_s, 3),
            "relay_us_per_token": round(per_unit(t.relay_cpu_s, t.tokens, 1e6), 1),
            "relay_ms_per_request": round(per_unit(t.relay_cpu_s, t.requests, 1e3), 3),
            "req_per_relay_cpu_s": round(t.requests / t.relay_cpu_s) if t.relay_cpu_s else None,
            "relay_writes_per_token": round(t.relay_writes / t.tokens, 3) if t.tokens else 0.0,
            "relay_us_per_write": round(per_unit(t.relay_cpu_s, t.relay_writes, 1e6), 1),
            "worker_us_per_token": round(per_unit(t.worker_cpu_s, t.tokens, 1e6), 1),
            "worker_engine_us_per_token": round(per_unit(t.engine_cpu_s, t.tokens, 1e6), 1),
            "latency_p50_ms": round(pct(t.latencies_s, 50) * 1e3, 3),
            "latency_p99_ms": round(pct(t.latencies_s, 99) * 1e3, 3)}
        if t.decisions is not None:
            for q in (50, 99):
                got = histogram_quantile(t.decisions, q / 100)
                row[f"decision_p{q}_us"] = None if got is None else round(got * 1e6, 1)
        if t.chunks:
            row["read_relay_share"] = round(t.relayed / t.chunks, 3)
        if t.gc_s is not None:
            row["relay_gc_us_per_request"] = round(per_unit(t.gc_s, t.requests, 1e6), 1)
        out.append(row)
    return with_added_latency(with_ratios(out))


def _same(rows_: Iterable[dict[str, Any]], relay: str) -> dict[tuple[str, int], dict[str, Any]]:
    return {(r["load"], r.get("concurrency", 0)): r for r in rows_ if r["relay"] == relay}


def with_ratios(out: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """kvpool's rows (kvpool-base's too) get `ratio_*`: their figure over nginx's on the same
    load and concurrency (None without nginx). Per write as well as per token: a relay that
    relays fewer, larger pieces than nginx (its worker's frames merged while it was busy)
    looks cheaper per token than its cost per piece says."""
    nginx = _same(out, "nginx")
    for r in out:
        if not r["relay"].startswith("kvpool"):
            continue
        n = nginx.get((r["load"], r.get("concurrency", 0)))
        for key in ("relay_us_per_token", "relay_ms_per_request", "req_per_s",
                    "relay_us_per_write"):
            r[f"ratio_{key}"] = round(r[key] / n[key], 2) if n and n.get(key) and \
                r.get(key) is not None else None
    return out


def with_added_latency(out: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every relay's row gets `added_p50_ms` / `added_p99_ms`: its latency over the direct
    row's on the same load and concurrency (absent without a direct row)."""
    direct = _same(out, DIRECT)
    for r in out:
        d = direct.get((r["load"], r.get("concurrency", 0)))
        if d is None or r["relay"] == DIRECT:
            continue
        for q in (50, 99):
            r[f"added_p{q}_ms"] = round(r[f"latency_p{q}_ms"] - d[f"latency_p{q}_ms"], 3)
    return out


def worker_text(row: dict[str, Any]) -> str:
    """The workers' CPU per token, and how much of it their engine threads spent (the
    emulated step a GPU engine would take over; the rest is serving: HTTP, frames)."""
    text = f"  (worker {row['worker_us_per_token']:.1f} us/token"
    engine = row.get("worker_engine_us_per_token")
    return text + (f", engine thread {engine:.1f})" if engine else ")")


def fmt(row: dict[str, Any]) -> str:
    head = (f"{row['relay']:<11} {row['load']:<10} c={row['concurrency']:<3} "
            f"{row['req_per_s']:8.1f} req/s {row['tokens_per_s']:9.0f} tok/s  "
            f"p50/p99 {row['latency_p50_ms']:.2f}/{row['latency_p99_ms']:.2f} ms")
    if "added_p50_ms" in row:
        head += f" (+{row['added_p50_ms']:.2f}/+{row['added_p99_ms']:.2f} over direct)"
    if row["relay"] == DIRECT:
        return head + worker_text(row)
    line = (f"{head}  relay CPU {row['relay_us_per_token']:7.1f} us/token "
            f"{row['relay_ms_per_request']:7.3f} ms/request")
    if row.get("req_per_relay_cpu_s"):
        line += f" ({row['req_per_relay_cpu_s']} req/CPU-s)"
    if row.get("relay_writes_per_token"):
        line += (f" {row['relay_writes_per_token']:.2f} writes/token "
                 f"{row['relay_us_per_write']:.1f} us/write")
    line += worker_text(row)
    if row.get("decision_p50_us") is not None:
        line += f"  decision p50/p99 {row['decision_p50_us']}/{row['decision_p99_us']} us"
    if row.get("read_relay_share") is not None:
        line += f"  {100 * row['read_relay_share']:.0f}% of chunks relayed in the read callback"
    if row.get("relay_gc_us_per_request") is not None:
        line += f"  gc {row['relay_gc_us_per_request']:.0f} us/request"
    ratio = row.get("ratio_relay_us_per_token")
    if ratio:
        line += (f"  x{ratio:.1f} nginx per token, x{row['ratio_relay_ms_per_request']:.1f} "
                 f"per request, x{row['ratio_req_per_s']:.2f} req/s")
        if row.get("ratio_relay_us_per_write"):
            line += f", x{row['ratio_relay_us_per_write']:.1f} per write"
    return line
