"""A single master with --state-dir SIGKILLed while a client puts and reads, then started
again on the same ports: the workload resumes, every acknowledged object reads back with its
bytes, and no read anywhere returned wrong bytes."""

from __future__ import annotations

import time
from contextlib import ExitStack
from pathlib import Path

import pytest

from kvpool.bench.faults_procs import Ledger, PutLoad
from kvpool.launch.store import owned, spawn_kvpool, start_master, start_nodes
from kvpool.launch.wait import wait_port
from kvpool.store.client.config import ClientConfig
from kvpool.store.client.store_client import StoreClient


@pytest.mark.slow  # 19 s; test_persist_restart keeps a SIGKILL and restart in the default suite
def test_master_sigkill_under_load_loses_nothing(tmp_path: Path) -> None:
    with ExitStack() as stack:
        master, address, argv = start_master(stack, "--state-dir", str(tmp_path))
        start_nodes(stack, address, 2, "32MiB")
        ledger = Ledger("mr")
        with StoreClient(ClientConfig(master=address, rpc_timeout_s=1.0,
                                      transfer_timeout_s=3.0)) as store:
            assert ledger.put_until(store, 20, timeout_s=40) is not None
            load = PutLoad(store, ledger, max_objects=800)
            load.start()
            time.sleep(1.0)
            master.kill()
            master.wait()
            killed = time.monotonic()
            time.sleep(0.5)
            owned(stack, spawn_kvpool(*argv))
            wait_port(int(address.rsplit(":", 1)[1]), timeout_s=30)
            deadline = time.monotonic() + 30
            while not [t for t in load.successes if t > killed + 1] and \
                    time.monotonic() < deadline:
                time.sleep(0.1)
            time.sleep(1.0)
            load.stop_event.set()
            load.join(30)
            assert [t for t in load.failures if t > killed], "the kill missed the workload"
            assert [t for t in load.successes if t > killed + 1], "the workload did not resume"
            lost, wrong = ledger.check_all(store)
        assert (lost, wrong, ledger.wrong_bytes) == (0, 0, 0)
        print(f"\n{len(ledger.acked)} acknowledged, 0 lost; client errors {ledger.errors}")
