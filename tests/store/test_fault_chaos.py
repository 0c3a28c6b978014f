"""A bounded randomized stall-and-kill run: client processes put and get while store nodes and
the master are SIGSTOPped and SIGKILLed at random. At the end every acknowledged object is
either intact or reported missing, and no read anywhere returned wrong bytes as OK."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time

import pytest

from kvpool.store.client.config import ClientConfig
from kvpool.store.client.store_client import StoreClient
from tests.store.cluster import Cluster, content, store_cluster
from tests.support.procs import running, spawn_python

WORKER = r"""
import hashlib, json, random, sys, time
import numpy as np
from kvpool.store.client.store_client import StoreClient
from kvpool.store.client.config import ClientConfig
from kvpool.store.config import ReplicateConfig

def content(key, size):
    seed = np.frombuffer(hashlib.blake2b(key.encode(), digest_size=64).digest(), np.uint8)
    return np.resize(seed, size).tobytes()

master, metadata, name, seconds = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
rng = random.Random(name)
c = StoreClient(ClientConfig(master=master, metadata=metadata, heartbeat_interval_s=0.2,
                             rpc_timeout_s=1.0, transfer_timeout_s=2.0))
acked, wrong, reads, n = [], 0, 0, 0
print(json.dumps({"ready": name}), flush=True)
sys.stdin.readline()
end = time.monotonic() + seconds
while time.monotonic() < end:
    if acked and rng.random() < 0.5:
        key = rng.choice(acked)
        got = c.get(key)
        reads += 1
        if got.ok and got.data != content(key, len(got.data)):
            wrong += 1
            print(json.dumps({"wrong": key}), flush=True)
        continue
    key = f"{name}-{n}"
    n += 1
    size = rng.choice([4096, 65536, 262144])
    if c.put(key, content(key, size), ReplicateConfig(replica_num=rng.choice([1, 2]))).ok:
        acked.append(key)
print(json.dumps({"acked": acked, "wrong": wrong, "reads": reads}), flush=True)
sys.stdin.readline()
c.close()
"""


def chaos(cluster: Cluster, rng: random.Random, seconds: float) -> list[str]:
    """One fault at a time, for `seconds`; returns what was done."""
    done = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(rng.uniform(0.5, 2.0))
        action = rng.choice(["stop-node", "stop-node", "stop-master", "kill-node",
                             "kill-master"])
        done.append(action)
        if action == "stop-node" or action == "stop-master":
            proc = cluster.master if action == "stop-master" else rng.choice(cluster.nodes)
            proc.send_signal(signal.SIGSTOP)
            time.sleep(rng.uniform(0.3, 4.0))    # sometimes past client_ttl (2 s)
            proc.send_signal(signal.SIGCONT)
        elif action == "kill-node":
            victim = rng.choice(cluster.nodes)
            victim.kill()
            victim.wait()
            cluster.nodes.remove(victim)
            cluster.add_node("16MiB")
        else:
            cluster.kill_master()
            cluster.start_master()
    return done


@pytest.mark.slow
def test_random_stalls_and_kills_never_serve_wrong_bytes() -> None:
    rng = random.Random(int(os.environ.get("KVPOOL_CHAOS_SEED", "20261130")))
    with store_cluster(3, "16MiB", "--client-ttl", "2", "--lease-ttl-ms", "1000",
                       http_metadata=True) as cluster:
        workers = [spawn_python(WORKER, cluster.address, cluster.metadata, f"w{i}", "50")
                   for i in range(3)]
        with running(workers[0]), running(workers[1]), running(workers[2]):
            for worker in workers:                 # all started before the first fault
                assert worker.stdout is not None and worker.stdin is not None
                assert "ready" in json.loads(worker.stdout.readline())
            for worker in workers:
                worker.stdin.write(b"go\n")      # type: ignore[union-attr]
                worker.stdin.flush()              # type: ignore[union-attr]
            actions = chaos(cluster, rng, 45)
            summaries = [finish(w) for w in workers]
            for proc in [cluster.master, *cluster.nodes]:
                proc.send_signal(signal.SIGCONT)
            assert all(p.poll() is None for p in [cluster.master, *cluster.nodes]), actions
            cluster.wait_segments(3, timeout_s=15)
            acked = [k for s in summaries for k in s["acked"]]
            assert sum(s["wrong"] for s in summaries) == 0, summaries
            with StoreClient(ClientConfig(master=cluster.address, metadata=cluster.metadata,
                                          heartbeat_interval_s=0.2)) as reader:
                intact = 0
                for key in acked:
                    got = reader.get(key)
                    if got.ok:
                        assert got.data == content(key, len(got.data)), key
                        intact += 1
            assert acked and sum(s["reads"] for s in summaries) > 0
            print(f"chaos: {actions}; {len(acked)} acknowledged, {intact} intact at the end")
            cluster.check_integrity()


def finish(worker: subprocess.Popen[bytes]) -> dict:  # type: ignore[type-arg]
    assert worker.stdout is not None
    for line in worker.stdout:
        record = json.loads(line)
        if "acked" in record:
            return record  # type: ignore[no-any-return]
    raise AssertionError("a worker died without a summary")
