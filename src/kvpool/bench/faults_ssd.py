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
from collections.abc import Sequence
from contextlib import ExitStack
from typing import Any

from kvpool.bench.faults_procs import content, start_master, start_nodes, wait_until
from kvpool.sim.cache import hit_rate
from kvpool.sim.trace import load_trace
from kvpool.store.client.config import ClientConfig
from kvpool.store.client.store_client import StoreClient
from kvpool.store.wire.codes import ErrorCode, Tier

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
    """Read GB/s of a working set that fits DRAM, beside one four times DRAM on DRAM+SSD;
    objects that reads moved back to DRAM per second (from the master's /segments tiers)."""
    if not with_ssd:
        return {"dram_read_gb_s": NA, "ssd_read_gb_s": NA, "promotions_per_s": NA}
    dram = _read_rate(dram_bytes, dram_bytes // 2, object_bytes, 0)
    ssd = _read_rate(dram_bytes, dram_bytes * 4, object_bytes, dram_bytes * 8)
    return {"dram_read_gb_s": dram["gb_s"], "ssd_read_gb_s": ssd["gb_s"],
            "promotions_per_s": ssd["promotions_per_s"]}


def _read_rate(dram: int, working_set: int, object_bytes: int, ssd: int) -> dict[str, Any]:
    with ExitStack() as stack:
        _, address, _ = start_master(stack, "--lease-ttl-ms", "500")
        extra: tuple[str, ...] = ()
        if ssd:
            ssd_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvp-ssd-"))
            extra = ("--ssd", ssd_dir, "--ssd-size", str(ssd))
        start_nodes(stack, address, 1, str(dram), *extra)
        keys = [f"r{i}" for i in range(working_set // object_bytes)]
        with StoreClient(ClientConfig(master=address, local_buffer_size=64 << 20)) as store:
            wait_until(lambda: store.put(keys[0], content(keys[0], object_bytes)).ok, 60.0)
            for key in keys[1:]:
                store.put(key, content(key, object_bytes))
            before = _dram_objects(store, keys)
            t0 = time.monotonic()
            got = store.get_batch(keys)
            elapsed = time.monotonic() - t0
            moved = max(0, _dram_objects(store, keys) - before)
        good = sum(1 for k, g in zip(keys, got, strict=True)
                   if g.ok and g.data == content(k, object_bytes))
        return {"gb_s": round(good * object_bytes / elapsed / 1e9, 3),
                "promotions_per_s": round(moved / elapsed, 1)}


def _dram_objects(store: StoreClient, keys: Sequence[str]) -> int:
    """Objects with a replica on a DRAM segment."""
    found = store.replica_desc_batch(list(keys))
    return sum(1 for r in found if r.code == ErrorCode.OK
               and any(d.tier == Tier.DRAM for d in r.replicas))
