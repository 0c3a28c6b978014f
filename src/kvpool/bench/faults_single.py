"""Fault figures without etcd: a single master with `--state-dir` SIGKILLed and restarted,
and a store node SIGKILLed under replica_num=2."""

from __future__ import annotations

import tempfile
import time
from contextlib import ExitStack
from typing import Any

from kvpool.bench.faults_procs import Ledger, wait_until
from kvpool.launch.store import start_master, start_nodes, start_ready
from kvpool.store.client.config import ClientConfig
from kvpool.store.client.store_client import StoreClient


def bench_master_restart(num_objects: int = 200) -> dict[str, Any]:
    """SIGKILL a master with a state directory and start it again on the same ports: seconds
    until it answers, until every acknowledged object reads back, and objects lost."""
    with ExitStack() as stack:
        state = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvp-state-"))
        master, address, argv = start_master(stack, "--state-dir", state)
        start_nodes(stack, address, 2)
        ledger = Ledger("restart")
        with StoreClient(ClientConfig(master=address, rpc_timeout_s=1.0)) as store:
            wait_until(lambda: ledger.put_one(store), 60.0, 0.1)
            ledger.put_until(store, num_objects - 1)
            ledger.errors.clear()
            master.kill()
            master.wait()
            killed = time.monotonic()
            start_ready(stack, *argv, what="the restarted master", timeout_s=60)  # listening
            answering = time.monotonic()
            lost, wrong = ledger.check_all(store, timeout_s=60.0)
            all_back = time.monotonic()
            first_put = ledger.put_until(store, 1) or float("nan")
        return {"objects": num_objects, "listening_s": round(answering - killed, 2),
                "all_readable_s": round(all_back - killed, 2),
                "first_put_s": round(first_put - killed, 2),
                "lost": lost, "wrong": wrong + ledger.wrong_bytes,
                "errors": dict(ledger.errors)}


def bench_node_kill(num_objects: int = 200) -> dict[str, Any]:
    """SIGKILL one of three store nodes holding replica_num=2 objects: objects lost and
    bytes wrong at once (reads fall back to the other replica) and after the master has
    declared the node dead (client ttl 2 s); puts go on."""
    with ExitStack() as stack:
        _, address, _ = start_master(stack, "--client-ttl", "2")
        nodes = start_nodes(stack, address, 3)
        ledger = Ledger("node")
        with StoreClient(ClientConfig(master=address, rpc_timeout_s=2.0,
                                      transfer_timeout_s=2.0)) as store:
            wait_until(lambda: ledger.put_one(store, 2), 60.0, 0.1)
            ledger.put_until(store, num_objects - 1, replicas=2)
            ledger.errors.clear()
            nodes[0].kill()
            nodes[0].wait()
            t0 = time.monotonic()
            lost_now, wrong_now = ledger.check_all(store, timeout_s=0.0)
            read_s = time.monotonic() - t0
            time.sleep(3.0)
            lost_later, wrong_later = ledger.check_all(store, timeout_s=0.0)
            put_ok = ledger.put_until(store, 20, timeout_s=30.0, replicas=2) is not None
        return {"objects": num_objects, "lost_at_once": lost_now,
                "lost_after_ttl": lost_later, "wrong": wrong_now + wrong_later +
                ledger.wrong_bytes, "read_all_s": round(read_s, 2), "puts_resume": put_ok,
                "errors": dict(ledger.errors)}
