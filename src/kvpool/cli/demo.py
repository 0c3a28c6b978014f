"""The workload `kvpool up --demo` runs against its local cluster."""

from __future__ import annotations

import hashlib
import signal
import time
from typing import TYPE_CHECKING

import numpy as np

from kvpool.store.client import StoreClient
from kvpool.store.client_config import ClientConfig
from kvpool.store.config import ReplicateConfig

if TYPE_CHECKING:
    from kvpool.cli.up_cmd import LocalCluster

NUM_OBJECTS = 64
OBJECT_BYTES = 256 << 10
BATCH_KEYS = 32
BATCH_OBJECT_BYTES = 1 << 20


def _payload(key: str, size: int) -> bytes:
    seed = np.frombuffer(hashlib.blake2b(key.encode(), digest_size=64).digest(), np.uint8)
    return np.resize(seed, size).tobytes()


def run_demo(cluster: LocalCluster, bench: bool = True) -> int:
    config = ClientConfig(master=cluster.master_address, local_hostname=cluster.host,
                          metadata=cluster.metadata_url, local_buffer_size=64 << 20)
    with StoreClient(config) as client:
        ok = _replicated_puts(client) and _zero_copy_batches(client) and _survive_kill(client, cluster)
    _print_admin(cluster)
    if ok and bench:
        _transfer_bench()
    print("demo: " + ("all checks passed" if ok else "FAILED"), flush=True)
    return 0 if ok else 1


def _replicated_puts(client: StoreClient) -> bool:
    two = ReplicateConfig(replica_num=2)
    keys = [f"demo/block/{i}" for i in range(NUM_OBJECTS)]
    start = time.perf_counter()
    puts = [client.put(key, _payload(key, OBJECT_BYTES), two) for key in keys]
    put_s = time.perf_counter() - start
    start = time.perf_counter()
    gets = [client.get(key) for key in keys]
    get_s = time.perf_counter() - start
    good = all(p.ok for p in puts) and all(g.ok and g.data == _payload(k, OBJECT_BYTES)
                                           for k, g in zip(keys, gets, strict=True))
    print(f"demo: {NUM_OBJECTS} x {OBJECT_BYTES >> 10} KiB objects, 2 replicas each: "
          f"put {NUM_OBJECTS / put_s:,.0f}/s, get {NUM_OBJECTS / get_s:,.0f}/s, "
          f"content verified: {good}", flush=True)
    return good


def _zero_copy_batches(client: StoreClient) -> bool:
    src = np.random.default_rng(0).integers(0, 256, BATCH_KEYS * BATCH_OBJECT_BYTES, dtype=np.uint8)
    dst = np.zeros_like(src)
    client.register_buffer(src)
    client.register_buffer(dst)
    keys = [f"demo/batch/{i}" for i in range(BATCH_KEYS)]
    addrs = [src.ctypes.data + i * BATCH_OBJECT_BYTES for i in range(BATCH_KEYS)]
    sizes = [BATCH_OBJECT_BYTES] * BATCH_KEYS
    start = time.perf_counter()
    puts = client.batch_put_from(keys, addrs, sizes)
    put_s = time.perf_counter() - start
    start = time.perf_counter()
    reads = client.batch_get_into(keys, [a - src.ctypes.data + dst.ctypes.data for a in addrs], sizes)
    get_s = time.perf_counter() - start
    good = all(p.ok for p in puts) and all(r.ok for r in reads) and bool((src == dst).all())
    total = BATCH_KEYS * BATCH_OBJECT_BYTES / 1e9
    print(f"demo: zero-copy batch of {BATCH_KEYS} x 1 MiB: put {total / put_s:.2f} GB/s, "
          f"get {total / get_s:.2f} GB/s, content verified: {good}", flush=True)
    return good


def _survive_kill(client: StoreClient, cluster: LocalCluster) -> bool:
    victim = cluster.nodes[0]
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    keys = [f"demo/block/{i}" for i in range(NUM_OBJECTS)]
    gets = [client.get(key) for key in keys]
    intact = sum(g.ok and g.data == _payload(k, OBJECT_BYTES) for k, g in zip(keys, gets, strict=True))
    wrong = sum(g.ok and g.data != _payload(k, OBJECT_BYTES) for k, g in zip(keys, gets, strict=True))
    print(f"demo: killed store node pid {victim.pid} (SIGKILL); replicated objects still readable: "
          f"{intact}/{NUM_OBJECTS}, wrong bytes returned: {wrong}", flush=True)
    return intact == NUM_OBJECTS and wrong == 0


def _print_admin(cluster: LocalCluster) -> None:
    segments = cluster.admin("/segments").json()
    print(f"demo: master reports {len(segments)} mounted segment(s)")
    metrics = cluster.admin("/metrics").text.splitlines()
    shown = [line for line in metrics if line.startswith(("kvpool_keys", "kvpool_ops_total"))][:6]
    for line in shown:
        print(f"  {line}")


def _transfer_bench() -> None:
    import argparse

    from kvpool.bench.transfer import run

    print("\ntransfer engine, target in another process (kvpool bench transfer --quick):", flush=True)
    run(argparse.Namespace(quick=True, sizes=None, transports="tcp,shm", no_mooncake=False,
                           seconds=None, json=False))
