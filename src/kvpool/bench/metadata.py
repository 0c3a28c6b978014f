"""Latency and throughput of metadata backends: `python -m kvpool.bench.metadata`.

Measures put/get/delete of a segment-descriptor-sized value (1 KiB by default) against an
in-process MemoryBackend, the HTTP server on a loopback port, and (with --etcd) a real etcd;
then the aggregate put rate of several threads sharing one backend.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections.abc import Callable

from kvpool.metadata.base import MetadataBackend
from kvpool.metadata.memory import MemoryBackend
from kvpool.metadata.uri import connect_metadata


def time_ops(fn: Callable[[int], object], num_ops: int) -> list[float]:
    """Seconds taken by each of `num_ops` calls fn(0..num_ops-1)."""
    samples = []
    for i in range(num_ops):
        started = time.perf_counter()
        fn(i)
        samples.append(time.perf_counter() - started)
    return samples


def threaded_rate(backend: MetadataBackend, value: bytes, num_threads: int, num_ops: int) -> float:
    """Puts per second of `num_threads` threads each doing `num_ops` puts."""

    def worker(t: int) -> None:
        for i in range(num_ops):
            backend.put(f"bench/mt/{t}/{i}", value)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(num_threads)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return num_threads * num_ops / (time.perf_counter() - started)


def bench_backend(name: str, backend: MetadataBackend, value: bytes, num_ops: int) -> None:
    ops: dict[str, Callable[[int], object]] = {
        "put": lambda i: backend.put(f"bench/{i}", value),
        "get": lambda i: backend.get(f"bench/{i}"),
        "delete": lambda i: backend.delete(f"bench/{i}"),
    }
    for op, fn in ops.items():
        samples = sorted(time_ops(fn, num_ops))
        p50 = statistics.median(samples) * 1e6
        p99 = samples[int(0.99 * (len(samples) - 1))] * 1e6
        print(f"{name:<8} {op:<8} {len(samples) / sum(samples):>10.0f} {p50:>10.1f} {p99:>10.1f}")
    rate = threaded_rate(backend, value, 8, max(1, num_ops // 8))
    print(f"{name:<8} {'put x8':<8} {rate:>10.0f} {'':>10} {'':>10}")


def bench_remote(name: str, uri: str, value: bytes, num_ops: int) -> None:
    backend = connect_metadata(uri)
    assert backend is not None
    with backend:
        bench_backend(name, backend, value, num_ops)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--ops", type=int, default=2000, help="operations per measurement")
    parser.add_argument("--value-bytes", type=int, default=1024)
    parser.add_argument("--etcd", default=None, help="host:port of an etcd to include")
    args = parser.parse_args(argv)
    from kvpool.metadata.server import MetadataServer

    value = bytes(args.value_bytes)
    print(f"{'backend':<8} {'op':<8} {'ops/s':>10} {'p50 us':>10} {'p99 us':>10}")
    bench_backend("memory", MemoryBackend(), value, args.ops)
    with MetadataServer(port=0) as server:
        bench_remote("http", server.url, value, args.ops)
    if args.etcd:
        bench_remote("etcd", "etcd://" + args.etcd, value, args.ops)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
