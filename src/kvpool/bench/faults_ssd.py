"""SSD-tier figures of `kvpool bench faults`, and the trace hit-rate experiment.

`ssd_tier_available()` asks `kvpool store-node --help` whether it offers `--ssd`; without it
the SSD rows read "n/a (no SSD tier)". The hit-rate experiment runs either way: the
conversation trace's block keys (one key per prefix-chained 512-token block hash, as the
simulator's cache sees them) are replayed through a real pool whose DRAM holds 10% of the
trace's distinct blocks. For each request the client reads its blocks (a prefix hit is a
leading block that reads back, with its bytes checked) and puts the ones it missed. The
simulator's LRU cache of the same capacity is printed beside it.
"""

from __future__ import annotations

import math
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from contextlib import ExitStack
from typing import Any

from kvpool.bench.faults_procs import content, wait_until
from kvpool.launch.store import start_master, start_nodes
from kvpool.sim.cache import hit_rate
from kvpool.sim.trace import load_trace
from kvpool.store.client.config import ClientConfig
from kvpool.store.client.store_client import StoreClient
from kvpool.store.wire.codes import ErrorCode

NA = "n/a (no SSD tier)"
BLOCK_BYTES = 64
"""Payload per trace block: one allocator unit, so the replay measures the cache, not copies."""
DRAM_SHARE = 0.10


def ssd_tier_available() -> bool:
    """True when `kvpool store-node --help` lists `--ssd`."""
    out = subprocess.run([sys.executable, "-m", "kvpool", "store-node", "--help"],
                         capture_output=True, text=True, timeout=60)
    return "--ssd" in out.stdout


def trace_blocks(limit: int | None) -> list[tuple[int, ...]]:
    return [r.block_hashes for r in load_trace(None, limit)]


def replay(store: StoreClient, requests: Sequence[Sequence[int]]) -> tuple[float, int, int]:
    """(prefix hit rate, wrong reads, failed puts) of `requests` replayed through `store`."""
    hits = total = wrong = failed = 0
    for hashes in requests:
        keys = list(dict.fromkeys(f"blk-{h}" for h in hashes))
        got = store.get_batch(keys)
        lead = next((i for i, g in enumerate(got) if not g.ok), len(got))
        hits += lead
        total += len(hashes)
        wrong += sum(1 for k, g in zip(keys, got, strict=True)
                     if g.ok and g.data != content(k, BLOCK_BYTES))
        missing = [k for k, g in zip(keys, got, strict=True) if not g.ok]
        if missing:
            puts = store.put_batch(missing, [content(k, BLOCK_BYTES) for k in missing])
            failed += sum(1 for r in puts if not r.ok)
    return (hits / total if total else 0.0), wrong, failed


def pool_hit_rate(requests: Sequence[Sequence[int]], capacity_blocks: int,
                  ssd_bytes: int = 0) -> dict[str, Any]:
    """Hit rate of a real pool with DRAM for `capacity_blocks` blocks (and an SSD tier of
    `ssd_bytes` when > 0)."""
    dram = capacity_blocks * BLOCK_BYTES
    with ExitStack() as stack:
        _, address, _ = start_master(stack, "--lease-ttl-ms", "500",
                                     "--high-watermark", "0.99", "--eviction-ratio", "0.01")
        extra: tuple[str, ...] = ()
        if ssd_bytes:
            ssd_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvp-ssd-"))
            extra = ("--ssd", ssd_dir, "--ssd-size", str(ssd_bytes))
        start_nodes(stack, address, 1, str(dram), *extra)
        with StoreClient(ClientConfig(master=address, rpc_timeout_s=10.0)) as store:
            wait_until(lambda: store.put("probe", b"p").ok, 60.0, 0.1)
            store.remove("probe", force=True)
            t0 = time.monotonic()
            rate, wrong, failed = replay(store, requests)
            return {"hit_rate": round(rate, 4), "wrong": wrong, "failed_puts": failed,
                    "seconds": round(time.monotonic() - t0, 1)}


def hit_rate_rows(limit: int | None, with_ssd: bool) -> dict[str, Any]:
    requests = trace_blocks(limit)
    distinct = len({h for r in requests for h in r})
    capacity = max(1, math.ceil(distinct * DRAM_SHARE))
    row: dict[str, Any] = {"requests": len(requests), "distinct_blocks": distinct,
                           "dram_blocks": capacity,
                           "sim_lru_hit_rate": round(hit_rate(requests, capacity, "lru"), 4),
                           "sim_unbounded_hit_rate": round(hit_rate(requests, None, "lru"), 4),
                           "dram": pool_hit_rate(requests, capacity)}
    row["dram_ssd"] = (pool_hit_rate(requests, capacity, distinct * BLOCK_BYTES * 2)
                       if with_ssd else NA)
    return row


def ssd_read_rows(with_ssd: bool, object_bytes: int = 1 << 20,
                  dram_bytes: int = 64 << 20) -> dict[str, Any]:
    """Read GB/s of a working set that fits DRAM (half of it), beside one four times DRAM
    on DRAM+SSD, both read the same way: passes in key order, `READ_BATCH_BYTES` per
    get_batch (a batch that fits DRAM; one batch of the whole set could never be in DRAM
    at once), the same number of bytes in both runs (two passes over the large set, 16
    over the small one). In the SSD run every read of the first pass finds its object on disk only
    (the last quarter put was pushed out by the loads before it), and so does the second
    (the set is 4x DRAM), which promotes (`--ssd-promote-after 2`). Promotions per second
    are the master's counter over both passes; `loaded_share` is loads per read."""
    if not with_ssd:
        return {"dram_read_gb_s": NA, "ssd_read_gb_s": NA, "promotions_per_s": NA}
    dram = _read_rate(dram_bytes, dram_bytes // 2, object_bytes, 0, READ_PASSES * 8)
    ssd = _read_rate(dram_bytes, dram_bytes * 4, object_bytes, dram_bytes * 8, READ_PASSES)
    return {"dram_read_gb_s": dram["gb_s"], "ssd_read_gb_s": ssd["gb_s"],
            "promotions_per_s": ssd["promotions_per_s"], "dram": dram, "ssd": ssd}


READ_BATCH_BYTES = 8 << 20
READ_PASSES = 2


def _read_rate(dram: int, working_set: int, object_bytes: int, ssd: int,
               passes: int) -> dict[str, Any]:
    with ExitStack() as stack:
        _, address, argv = start_master(stack, "--lease-ttl-ms", "500")
        metrics = f"http://127.0.0.1:{argv[argv.index('--metrics_port') + 1]}/metrics"
        extra: tuple[str, ...] = ()
        if ssd:
            ssd_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvp-ssd-"))
            extra = ("--ssd", ssd_dir, "--ssd-size", str(ssd))
        start_nodes(stack, address, 1, str(dram), *extra)
        keys = [f"r{i}" for i in range(working_set // object_bytes)]
        with StoreClient(ClientConfig(master=address, local_buffer_size=64 << 20)) as store:
            wait_until(lambda: store.put(keys[0], content(keys[0], object_bytes)).ok, 60.0)
            failed_puts = sum(not _put_patiently(store, k, content(k, object_bytes))
                              for k in keys[1:])
            before = _counters(metrics)
            t0 = time.monotonic()
            good = wrong = 0
            per_batch = max(1, READ_BATCH_BYTES // object_bytes)
            for _ in range(passes):
                for lo in range(0, len(keys), per_batch):
                    chunk = keys[lo:lo + per_batch]
                    for key, got in zip(chunk, store.get_batch(chunk), strict=True):
                        right = got.ok and got.data == content(key, object_bytes)
                        good += right
                        wrong += got.ok and not right
            elapsed = time.monotonic() - t0
            after = _counters(metrics)
        delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
        reads = passes * len(keys)
        return {"gb_s": round(good * object_bytes / elapsed / 1e9, 3),
                "promotions_per_s": round(delta.get("promotions", 0.0) / elapsed, 1),
                "promotions": int(delta.get("promotions", 0)), "reads": reads,
                "good_reads": good, "wrong": wrong, "failed_puts": failed_puts,
                "loaded_share": round(delta.get("loads", 0.0) / reads, 3),
                "seconds": round(elapsed, 2)}


def _put_patiently(store: StoreClient, key: str, value: bytes, timeout_s: float = 30.0) -> bool:
    """Put, retrying NO_AVAILABLE_HANDLE (DRAM full while the disk catches up) as a writer
    that must not lose the object would."""
    deadline = time.monotonic() + timeout_s
    while True:
        code = store.put(key, value).code
        if code != ErrorCode.NO_AVAILABLE_HANDLE or time.monotonic() > deadline:
            return code == ErrorCode.OK
        time.sleep(0.002)


def _counters(url: str) -> dict[str, float]:
    """The master's kvpool_master_ssd_* counters, by short name (loads, promotions, ...)."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("kvpool_master_ssd_") and line.split()[0].endswith("_total"):
            name, value = line.split()[:2]
            out[name[len("kvpool_master_ssd_"):-len("_total")]] = float(value)
    return out
