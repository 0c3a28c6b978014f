"""Fault figures with etcd: SIGKILL of the HA leader (failover time, objects lost, bytes
wrong, client errors in the window), and etcd restarted under a put/get load.

Each measurement starts its own masters and store nodes on one etcd (a fresh cluster id and
state directory per trial), so trials do not see each other's objects.
"""

from __future__ import annotations

import statistics
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

from kvpool.bench.faults_procs import Ledger, PutLoad, wait_until
from kvpool.launch.etcd import EtcdProcess
from kvpool.launch.store import HA_TTL_S, ha_cluster, wait_leader
from kvpool.store.client.store_client import StoreClient


@dataclass
class FailoverTrial:
    failover_s: float
    acked: int
    lost: int
    wrong: int
    errors: dict[str, int] = field(default_factory=dict)


def failover_trial(etcd: EtcdProcess, cluster_id: str, num_before: int = 100,
                   num_after: int = 50) -> FailoverTrial:
    with ExitStack() as stack:
        pair, leader, _ = ha_cluster(stack, etcd, cluster_id)
        ledger = Ledger(cluster_id)
        with StoreClient(pair.client_config()) as store:
            wait_until(lambda: ledger.put_one(store), 60.0, 0.1)
            ledger.put_until(store, num_before - 1)
            before = dict(ledger.errors)
            killed = time.monotonic()
            pair.masters[leader].kill()
            pair.masters[leader].wait()
            first_ok = ledger.put_until(store, num_after)
            window = {k: v - before.get(k, 0) for k, v in ledger.errors.items()
                      if v != before.get(k, 0)}
            lost, wrong = ledger.check_all(store)
        failover = (first_ok - killed) if first_ok is not None else float("nan")
        return FailoverTrial(failover, len(ledger.acked), lost, wrong + ledger.wrong_bytes,
                             window)


def bench_failover(etcd: EtcdProcess, trials: int) -> dict[str, Any]:
    runs = [failover_trial(etcd, f"fo{i}-{int(time.time())}") for i in range(trials)]
    errors: dict[str, int] = {}
    for run in runs:
        for kind, count in run.errors.items():
            errors[kind] = errors.get(kind, 0) + count
    return {"failover_s": [round(r.failover_s, 2) for r in runs],
            "failover_median_s": round(statistics.median(r.failover_s for r in runs), 2),
            "acked": sum(r.acked for r in runs), "lost": sum(r.lost for r in runs),
            "wrong": sum(r.wrong for r in runs), "window_errors": errors,
            "lease_ttl_s": HA_TTL_S}


def _etcd_outage(etcd: EtcdProcess, load: PutLoad, down_s: float) -> tuple[float, float]:
    """Kill etcd under `load`, start it after `down_s`, wait until the load has succeeded
    again after its last failure; (time killed, time etcd was back)."""
    time.sleep(1.0)
    killed = time.monotonic()
    etcd.kill()
    time.sleep(down_s)
    etcd.start()
    back = time.monotonic()
    wait_until(lambda: bool(load.successes) and load.successes[-1] > back + 0.5
               and (not load.failures or load.successes[-1] > load.failures[-1]), 60.0, 0.1)
    return killed, back


def bench_etcd_restart(etcd: EtcdProcess, down_s: float) -> dict[str, Any]:
    """SIGKILL etcd under load, start it again after `down_s`: client errors, time until
    puts succeed again, and the leader's term before and after."""
    cluster_id = f"etcd-{int(time.time())}"
    with ExitStack() as stack:
        pair, _, _ = ha_cluster(stack, etcd, cluster_id)
        ledger = Ledger(cluster_id)
        with StoreClient(pair.client_config()) as store:
            wait_until(lambda: ledger.put_one(store), 60.0, 0.1)
            _, term1 = wait_leader(etcd, cluster_id)
            ledger.errors.clear()   # refusals while the nodes were still mounting
            load = PutLoad(store, ledger)
            load.start()
            killed, back = _etcd_outage(etcd, load, down_s)
            _, term2 = wait_leader(etcd, cluster_id)
            time.sleep(HA_TTL_S + 1.0)   # a lease restored by etcd lapses by now
            _, term_end = wait_leader(etcd, cluster_id)
            load.stop_event.set()
            load.join(30)
            lost, wrong = ledger.check_all(store)
        last_failure = max((t for t in load.failures if t >= killed), default=None)
        return {"down_s": down_s, "etcd_back_s": round(back - killed, 2),
                "errors": sum(ledger.errors.values()), "error_kinds": dict(ledger.errors),
                "recovery_s": round(max(0.0, last_failure - back), 2) if last_failure else 0.0,
                "term_before": term1, "term_after": term2, "term_end": term_end,
                "master_exit_codes": [m.poll() for m in pair.masters],
                "acked": len(ledger.acked), "lost": lost, "wrong": wrong + ledger.wrong_bytes}
