"""`kvpool store-node drain` against real processes: a master, store nodes, the drain CLI,
and kill -9 of the drained node afterwards."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from kvpool.store.client.config import ClientConfig
from kvpool.store.client.store_client import StoreClient
from kvpool.store.config import ReplicateConfig
from kvpool.store.wire.codes import ErrorCode as E
from tests.store.cluster import Cluster, content, store_cluster
from tests.support.net import free_port, wait_port
from tests.support.procs import python_env, running, spawn_kvpool
from tests.support.wait import wait_for

KIB = 1024
TWO = ReplicateConfig(replica_num=2)


def drain_cli(cluster_address: str, *args: str, timeout_s: float = 120) -> \
        subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvpool", "store-node", "drain", *args,
                           "--master", cluster_address], env=python_env(),
                          capture_output=True, text=True, timeout=timeout_s, check=False)


def node_of(cluster: Cluster, index: int) -> tuple[str, subprocess.Popen[bytes]]:
    """The endpoint of the `index`-th mounted segment and the node process owning it (the
    client id carries the owner's pid)."""
    seg = cluster.segments()[index]
    pid = str(seg["client_id"]).split("-")[1]
    (proc,) = [p for p in cluster.nodes if str(p.pid) == pid]
    return str(seg["endpoint"]), proc


def segment_of(cluster: Cluster, endpoint: str) -> dict[str, object]:
    (seg,) = [s for s in cluster.segments() if s["endpoint"] == endpoint]
    return seg


@contextmanager
def client(cluster: Cluster) -> Iterator[StoreClient]:
    with StoreClient(ClientConfig(master=cluster.address)) as store:
        yield store


def fill(store: StoreClient, num: int, every_third_twice: bool = True) -> dict[str, int]:
    """`num` objects of 9..63 KiB, every third with two replicas."""
    sizes = {}
    for i in range(num):
        key, size = f"k{i}", (i % 7 + 1) * 9 * KIB + i
        two = every_third_twice and i % 3 == 0
        assert store.put(key, content(key, size), TWO if two else ReplicateConfig()).ok
        sizes[key] = size
    return sizes


def verify(store: StoreClient, expected: dict[str, bytes]) -> None:
    keys = sorted(expected)
    for i in range(0, len(keys), 64):
        chunk = keys[i:i + 64]
        for key, got in zip(chunk, store.get_batch(chunk), strict=True):
            assert got.code == E.OK, (key, got.code)
            assert got.data == expected[key], key


def kill_and_wait_gone(cluster: Cluster, proc: subprocess.Popen[bytes], left: int) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    cluster.wait_segments(left, timeout_s=30)


@pytest.mark.slow  # 14 s: the default suite keeps the other drain cases
def test_drain_then_kill_loses_nothing() -> None:
    with store_cluster(3, "16MiB", "--client_ttl", "2") as cluster, client(cluster) as store:
        sizes = fill(store, 150)
        addr, proc = node_of(cluster, 0)
        held = int(segment_of(cluster, addr)["used_bytes"])  # type: ignore[call-overload]
        assert held > 0
        dry = drain_cli(cluster.address, addr, "--dry-run")
        assert dry.returncode == 0, dry.stderr
        assert dry.stdout.startswith(f"would drain {addr}")
        assert segment_of(cluster, addr)["draining"] is False
        out = drain_cli(cluster.address, addr)
        assert out.returncode == 0, out.stdout + out.stderr
        assert "complete" in out.stdout and "0 could not be placed" in out.stdout
        assert segment_of(cluster, addr)["draining"] is True
        cluster.check_integrity()
        for i in range(20):  # new objects avoid the drained node
            assert store.put(f"new{i}", content(f"new{i}", 5000)).ok
            assert all(r.endpoint != addr for r in store.replica_desc(f"new{i}").replicas)
        kill_and_wait_gone(cluster, proc, 2)
        verify(store, {k: content(k, n) for k, n in sizes.items()})
        for key in list(sizes)[::3]:  # the replica count was kept where there was room
            assert len(store.replica_desc(key).replicas) == 2
        cluster.check_integrity()


def _churn(store: StoreClient, keys: list[str], stop: threading.Event,
           expected: dict[str, bytes], errors: list[str]) -> None:
    """Upsert and remove `keys` (at least 100 times, then until `stop`); `expected` holds
    what each acknowledged key must read back as (absent: removed)."""
    i = 0
    while not stop.is_set() or i < 100:
        key = keys[(i * 7) % len(keys)]
        if i % 5 == 4:
            code = store.remove(key, force=True)
            if code == E.OK:
                expected.pop(key, None)
            elif code != E.OBJECT_NOT_FOUND:
                errors.append(f"remove {key}: {code.name}")
        else:
            value = content(f"{key}/v{i}", 20 * KIB + i)
            if store.upsert(key, value).ok:
                expected[key] = value
            else:
                errors.append(f"upsert {key} failed")
        i += 1


@pytest.mark.slow  # 11 s
def test_drain_under_concurrent_upserts_and_removes(tmp_path: Path) -> None:
    """A writer upserts and removes the drained node's keys while the drain runs (in small
    batches): no acknowledged object is lost or read back with other bytes."""
    with store_cluster(3, "32MiB", "--client_ttl", "2") as cluster, client(cluster) as store:
        addr, proc = node_of(cluster, 1)
        expected = {}
        for i in range(300):
            key, two = f"c{i}", i % 4 == 0
            expected[key] = content(key, 40 * KIB + i)
            assert store.put(key, expected[key], ReplicateConfig(
                replica_num=2 if two else 1, preferred_segments=(addr,))).ok
        stop, errors = threading.Event(), []  # type: ignore[var-annotated]
        log = tmp_path / "drain.out"
        with log.open("w") as sink:
            cli = subprocess.Popen([sys.executable, "-m", "kvpool", "store-node", "drain",
                                    addr, "--master", cluster.address, "--batch-keys", "2"],
                                   env=python_env(), stdout=sink, text=True)
        wait_for(lambda: log.read_text().startswith("draining"), 60.0, "the drain to start")
        with client(cluster) as writer:
            churn = threading.Thread(target=_churn,
                                     args=(writer, sorted(expected), stop, expected, errors))
            churn.start()
            cli.wait(120)
            stop.set()
            churn.join(120)
        assert not errors, errors[:5]
        assert cli.returncode == 0, log.read_text()
        cluster.check_integrity()
        kill_and_wait_gone(cluster, proc, 2)
        verify(store, expected)
        gone = {f"c{i}" for i in range(300)} - set(expected)
        assert gone and all(store.get(k).code == E.OBJECT_NOT_FOUND for k in gone)
        cluster.check_integrity()


def test_drain_without_room_fails_clearly_and_keeps_the_node() -> None:
    with store_cluster(1, "32MiB") as cluster, client(cluster) as store:
        sizes = fill(store, 120, every_third_twice=False)  # about 4 MiB
        big = {f"big{i}": 1 << 20 for i in range(8)}
        for key, size in big.items():
            assert store.put(key, content(key, size)).ok
        addr, _ = node_of(cluster, 0)
        cluster.add_node("4MiB")
        cluster.wait_segments(2)
        out = drain_cli(cluster.address, addr)
        assert out.returncode == 1, out.stdout + out.stderr
        assert "INCOMPLETE" in out.stdout and "NO_AVAILABLE_HANDLE" in out.stdout
        assert "no node that stays has room" in out.stdout
        assert segment_of(cluster, addr)["draining"] is False  # usable again
        verify(store, {k: content(k, n) for k, n in (sizes | big).items()})
        cluster.check_integrity()
        assert store.put("after", b"x" * 5000,
                         ReplicateConfig(preferred_segments=(addr,))).ok
        assert [r.endpoint for r in store.replica_desc("after").replicas] == [addr]


def test_unknown_address_and_wrong_token() -> None:
    with store_cluster(1, "8MiB") as cluster:
        out = drain_cli(cluster.address, "127.0.0.1:1")
        assert out.returncode == 2
        assert "no mounted segment has endpoint 127.0.0.1:1" in out.stderr
        out = subprocess.run([sys.executable, "-m", "kvpool", "store-node", "drain",
                              "--master", cluster.address], env=python_env(),
                             capture_output=True, text=True, timeout=60, check=False)
        assert out.returncode == 2 and "ADDR" in out.stderr
    rpc, admin = free_port(), free_port()
    with running(spawn_kvpool("master", "--rpc_port", str(rpc), "--metrics_port", str(admin),
                              "--no-http-metadata", "--token", "right-token")):
        wait_port(rpc)
        env_token = os.environ.pop("KVPOOL_TOKEN", None)
        try:
            out = drain_cli(f"127.0.0.1:{rpc}", "127.0.0.1:1", "--token", "wrong-token")
            assert out.returncode == 2, out.stdout + out.stderr
            assert "did not answer" in out.stderr or "refused" in out.stderr
            out = drain_cli(f"127.0.0.1:{rpc}", "127.0.0.1:1", "--token", "right-token")
            assert out.returncode == 2 and "no mounted segment" in out.stderr
        finally:
            if env_token is not None:
                os.environ["KVPOOL_TOKEN"] = env_token


def test_store_node_without_dram_is_refused() -> None:
    out = subprocess.run([sys.executable, "-m", "kvpool", "store-node"], env=python_env(),
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 2 and "--dram" in out.stderr


@pytest.mark.slow  # 15 s
def test_drain_killed_midway_then_run_again() -> None:
    """kill -9 of the drain command after its first batch: nothing is lost, the node stays
    draining until `--cancel`, and the next run (once the dead run's moves are discarded)
    finishes."""
    with store_cluster(2, "64MiB", "--client_ttl", "2", "--put_start_discard_timeout_sec",
                       "2") as cluster, client(cluster) as store:
        addr, proc = node_of(cluster, 0)
        expected = {}
        for i in range(400):
            key = f"m{i}"
            expected[key] = content(key, 64 * KIB)
            assert store.put(key, expected[key],
                             ReplicateConfig(preferred_segments=(addr,))).ok
        cli = subprocess.Popen([sys.executable, "-m", "kvpool", "store-node", "drain", addr,
                                "--master", cluster.address, "--batch-keys", "4"],
                               env=python_env(), stdout=subprocess.PIPE, text=True)
        assert cli.stdout is not None
        assert cli.stdout.readline().startswith("draining")
        assert cli.stdout.readline().startswith("moved 4/400")
        cli.kill()
        cli.wait()
        assert segment_of(cluster, addr)["draining"] is True
        verify(store, expected)
        cluster.check_integrity()
        out = drain_cli(cluster.address, addr, "--cancel")
        assert out.returncode == 0 and "cancelled" in out.stdout, out.stderr
        assert segment_of(cluster, addr)["draining"] is False
        assert drain_cli(cluster.address, addr, "--cancel").returncode == 2
        out = drain_cli(cluster.address, addr)
        assert out.returncode == 0, out.stdout + out.stderr
        kill_and_wait_gone(cluster, proc, 1)
        verify(store, expected)
        cluster.check_integrity()
