"""SIGKILL of the HA leader while a client thread puts and reads without pause (the
sequential version is tests/store/master/test_ha_failover.py): the standby takes the next term, the
workload resumes on it, every acknowledged object reads back with its bytes and no read in
the whole run returned other bytes."""

from __future__ import annotations

import time
from contextlib import ExitStack
from pathlib import Path

from kvpool.bench.faults_procs import Ledger, PutLoad
from kvpool.launch.etcd import EtcdProcess
from kvpool.launch.store import ha_cluster, wait_leader
from kvpool.store.client.store_client import StoreClient
from tests.support.wait import wait_for


def test_leader_sigkill_under_a_running_workload(tmp_path: Path) -> None:
    with ExitStack() as stack:
        etcd = EtcdProcess(stack).start()
        pair, leader, term1 = ha_cluster(stack, etcd, "kill-under-load", ttl_s=2)  # journal in etcd
        ledger = Ledger("hk")
        with StoreClient(pair.client_config()) as store:
            assert ledger.put_until(store, 20, timeout_s=40) is not None
            load = PutLoad(store, ledger, max_objects=600)
            load.start()
            time.sleep(1.0)
            pair.masters[leader].kill()
            pair.masters[leader].wait()
            killed = time.monotonic()
            new_addr, term2 = wait_leader(etcd, pair.cluster_id, not_term=term1)
            wait_for(lambda: len([t for t in load.successes if t > killed]) >= 50, 30.0,
                     "50 puts acknowledged by the new leader", 0.1)
            load.stop_event.set()
            load.join(30)
            resumed = [t for t in load.successes if t > killed]
            assert len(resumed) >= 50, "the workload did not resume on the new leader"
            assert [t for t in load.failures if t > killed], "the kill missed the workload"
            lost, wrong = ledger.check_all(store)
        assert term2 == term1 + 1 and pair.index_of(new_addr) != leader
        assert (lost, wrong, ledger.wrong_bytes) == (0, 0, 0)
        print(f"\nfirst success {resumed[0] - killed:.2f}s after SIGKILL; "
              f"{len(ledger.acked)} acknowledged, 0 lost; errors {ledger.errors}")
