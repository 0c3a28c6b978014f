"""Busy polling in real processes: a master and store nodes that served a burst of
back-to-back requests poll while it lasts, and go back to sleeping once it is over (an idle
pool costs no CPU); with polling off they never poll."""

from __future__ import annotations

import re
import time

from kvpool.bench.mooncake_cpu import cpu_times
from kvpool.store.client.config import ClientConfig
from kvpool.store.client.store_client import StoreClient
from tests.store.cluster import Cluster, store_cluster

IDLE_S = 1.0


def _cpu_s(pid: int) -> float:
    return sum(cpu_times(pid))


def _burst(client: StoreClient, seconds: float) -> int:
    """Back-to-back puts and gets for `seconds`; the number of operations."""
    end, n = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        key = f"k{n % 50}"
        assert client.put(key, b"v" * 4096).ok
        assert client.get(key).data == b"v" * 4096
        n += 2
    return n


def _master_requests(cluster: Cluster) -> float:
    """Every RPC request the master has served (kvpool_master_ops, all ops)."""
    text = cluster.admin("/metrics").text
    return sum(float(n) for n in re.findall(r'^kvpool_master_ops_total\{op="[^"]+"\} (\S+)$',
                                             text, re.M))


def _cpu_while_idle(pids: list[int]) -> list[float]:
    before = [_cpu_s(p) for p in pids]
    time.sleep(IDLE_S)
    return [_cpu_s(p) - b for p, b in zip(pids, before, strict=True)]


def test_an_idle_pool_stops_polling_after_a_burst_of_requests() -> None:
    with store_cluster(1, "16MiB") as cluster, \
            StoreClient(ClientConfig(master=cluster.address)) as client:
        pids = [cluster.master.pid, cluster.nodes[0].pid]
        before, served = [_cpu_s(p) for p in pids], _master_requests(cluster)
        ops = _burst(client, 1.0)
        busy = [_cpu_s(p) - b for p, b in zip(pids, before, strict=True)]
        time.sleep(0.2)  # the last windows run out
        idle = _cpu_while_idle(pids)
        assert _master_requests(cluster) - served >= ops // 2  # every put went to the master
        assert busy[0] > 0.05  # the master worked (and polled) through the burst
        # idle: heartbeats and ticks only, far from a polling core (1 s of CPU per s)
        assert all(cpu < 0.15 for cpu in idle), (busy, idle)
        assert client.get("k0").data == b"v" * 4096  # and it answers at once again


def test_a_pool_with_polling_off_serves_the_same_requests() -> None:
    with store_cluster(1, "16MiB", "--request-poll-us", "0") as cluster, \
            StoreClient(ClientConfig(master=cluster.address, reply_poll_us=0,
                                     request_poll_us=0)) as client:
        served = _master_requests(cluster)
        ops = _burst(client, 0.3)
        assert ops > 0 and _master_requests(cluster) - served >= ops // 2
