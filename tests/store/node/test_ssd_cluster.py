"""The disk tier with real processes: a master, a store node with --ssd, a client.

Objects evicted from DRAM come back bit-exact through a plain `get`; reads promote; the disk
has its own watermark; a node killed with SIGKILL comes back with its files, minus the ones
a crash or a disk corrupted, which are never served; puts never wait for the disk."""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from kvpool.store import ClientConfig, StoreClient
from kvpool.store.node.ssd import SUFFIX
from kvpool.store.wire.codes import ErrorCode, Tier
from tests.store.cluster import Cluster, content, store_cluster
from tests.support.wait import wait_for

E = ErrorCode
SIZE = 256 * 1024


def add_ssd_node(cluster: Cluster, disk: Path, ssd_size: str = "64MiB",
                 promote_after: int = 2, dram: str = "4MiB") -> object:
    return cluster.start_node(
        "--dram", dram, "--master", cluster.address, "--heartbeat-interval",
        "0.2", "--ssd", str(disk), "--ssd-size", ssd_size, "--ssd-promote-after",
        str(promote_after))


@contextmanager
def ssd_cluster(disk: Path, **node_args: object) -> Iterator[tuple[Cluster, StoreClient]]:
    with store_cluster(0, "4MiB", "--client_ttl", "2") as cluster:
        add_ssd_node(cluster, disk, **node_args)  # type: ignore[arg-type]
        cluster.wait_segments(2)
        with StoreClient(ClientConfig(master=cluster.address, global_segment_size=0,
                                      rpc_timeout_s=20.0)) as client:
            yield cluster, client


def put_paced(client: StoreClient, keys: list[str], timeout_s: float = 60.0) -> None:
    """Put every key, retrying NO_AVAILABLE_HANDLE while the disk catches up."""
    deadline = time.monotonic() + timeout_s
    for key in keys:
        while (code := client.put(key, content(key, SIZE)).code) == E.NO_AVAILABLE_HANDLE:
            assert time.monotonic() < deadline, f"no room for {key} within {timeout_s}s"
            time.sleep(0.02)
        assert code == E.OK, (key, code)


def metric(cluster: Cluster, name: str) -> float:
    text = cluster.admin("/metrics").text
    found = re.search(rf"^{name}(?:_total)? ([0-9.e+]+)$", text, re.M)
    assert found, f"{name} not in /metrics"
    return float(found.group(1))


def files(disk: Path) -> list[str]:
    return [n for n in os.listdir(disk) if n.endswith(SUFFIX)]


def tiers_of(client: StoreClient, key: str) -> list[Tier]:
    return sorted(r.tier for r in client.replica_desc(key).replicas)


SSD_WAIT_S = 30.0
"""How long the disk tier's background work (offloads, registration, eviction) may take here."""


def test_evicted_objects_are_read_back_from_disk_and_promoted(tmp_path: Path) -> None:
    keys = [f"obj-{i}" for i in range(40)]              # 10 MiB through 4 MiB of DRAM
    with ssd_cluster(tmp_path) as (cluster, client):
        put_paced(client, keys)
        wait_for(lambda: metric(cluster, "kvpool_master_ssd_offloads") >= 24,
                 SSD_WAIT_S, "offloads")
        for key in keys:
            got = client.get(key)
            assert got.code == E.OK and got.data == content(key, SIZE), key
        assert metric(cluster, "kvpool_master_ssd_loads") > 0
        cold = keys[0]
        assert client.get(cold).ok and client.get(cold).ok   # read twice: promoted
        assert metric(cluster, "kvpool_master_ssd_promotions") >= 1
        segs = cluster.segments()
        assert sorted(s["tier"] for s in segs) == ["DRAM", "SSD"]
        assert client.stats.checksum_mismatches == 0
        cluster.check_integrity()


def test_puts_never_wait_for_the_disk(tmp_path: Path) -> None:
    keys = [f"burst-{i}" for i in range(60)]
    stored = []
    with ssd_cluster(tmp_path) as (cluster, client):
        for key in keys:                                  # as fast as the client goes
            t0 = time.monotonic()
            code = client.put(key, content(key, SIZE)).code
            assert time.monotonic() - t0 < 10.0, "a put waited"
            assert code in (E.OK, E.NO_AVAILABLE_HANDLE), code
            if code == E.OK:
                stored.append(key)
        assert len(stored) >= 16
        for key in stored:
            got = client.get(key)
            assert got.code == E.OK and got.data == content(key, SIZE), key
        cluster.check_integrity()


def test_the_disk_evicts_least_recently_used_at_its_watermark(tmp_path: Path) -> None:
    keys = [f"lru-{i}" for i in range(48)]            # 12 MiB: 4 in DRAM + 2 on disk
    with ssd_cluster(tmp_path, ssd_size="2MiB") as (cluster, client):
        put_paced(client, keys)
        wait_for(lambda: metric(cluster, "kvpool_master_ssd_disk_evicted_objects") > 0,
                 SSD_WAIT_S, "disk eviction")
        ssd = next(s for s in cluster.segments() if s["tier"] == "SSD")
        assert int(ssd["used_bytes"]) <= int(ssd["capacity_bytes"])  # type: ignore[call-overload]
        assert len(files(tmp_path)) <= 8
        assert client.get(keys[0]).code == E.OBJECT_NOT_FOUND      # the oldest: gone
        for key in keys:
            got = client.get(key)
            assert got.code in (E.OK, E.OBJECT_NOT_FOUND), (key, got.code)
            assert not got.ok or got.data == content(key, SIZE)
        cluster.check_integrity()


def flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))


def test_a_killed_node_comes_back_with_its_files_and_never_serves_bad_ones(
        tmp_path: Path) -> None:
    keys = [f"crash-{i}" for i in range(32)]
    with ssd_cluster(tmp_path) as (cluster, client):
        put_paced(client, keys)
        wait_for(lambda: len(files(tmp_path)) >= 16, SSD_WAIT_S, "offloads")
        time.sleep(0.5)
        node = cluster.nodes[0]
        node.send_signal(signal.SIGKILL)              # type: ignore[attr-defined]
        node.wait()                                   # type: ignore[attr-defined]
        on_disk = {key for key in keys if (tmp_path / _name(key)).exists()}
        corrupt, torn = sorted(on_disk)[:2]
        flip_last_byte(tmp_path / _name(corrupt))
        os.truncate(tmp_path / _name(torn), SIZE // 2)
        add_ssd_node(cluster, tmp_path)
        cluster.wait_segments(2)                      # the dead node's segments expired
        wait_for(lambda: metric(cluster, "kvpool_master_ssd_registered") >= len(on_disk) - 2,
                 SSD_WAIT_S, "registration")
        for key in keys:
            got = client.get(key)
            if key in on_disk - {corrupt, torn}:
                assert got.code == E.OK and got.data == content(key, SIZE), key
            else:
                assert got.code == E.OBJECT_NOT_FOUND, (key, got.code)
        assert not (tmp_path / _name(corrupt)).exists()
        assert not (tmp_path / _name(torn)).exists()
        assert client.stats.checksum_mismatches == 0
        cluster.check_integrity()


def _name(key: str) -> str:
    from kvpool.store.node.ssd import file_name
    return file_name(key)


@pytest.mark.slow  # 12 s
def test_objects_on_disk_survive_a_master_restart(tmp_path: Path) -> None:
    keys = [f"mr-{i}" for i in range(32)]
    with ssd_cluster(tmp_path) as (cluster, client):
        put_paced(client, keys)
        wait_for(lambda: len(files(tmp_path)) >= 16, SSD_WAIT_S, "offloads")
        time.sleep(0.5)
        cluster.kill_master()                          # no --state-dir: DRAM objects go
        on_disk = {key for key in keys if (tmp_path / _name(key)).exists()}
        cluster.start_master()
        wait_for(lambda: metric(cluster, "kvpool_master_ssd_registered") >= len(on_disk),
                 SSD_WAIT_S, "registration")
        for key in keys:
            got = client.get(key)
            if key in on_disk:
                assert got.code == E.OK and got.data == content(key, SIZE), key
            else:
                assert got.code == E.OBJECT_NOT_FOUND, (key, got.code)
        cluster.check_integrity()


@pytest.mark.slow  # 11 s; draining is in the default suite without a disk tier
def test_draining_a_disk_node_moves_its_disk_only_objects(tmp_path: Path) -> None:
    """`kvpool store-node drain` of a node with a disk tier: objects that live only on its
    disk are loaded into another node's DRAM and moved; after kill -9 every one reads back."""
    import subprocess
    import sys

    from tests.support.procs import python_env

    keys = [f"drain-{i}" for i in range(24)]              # 6 MiB through 4 MiB of DRAM
    with ssd_cluster(tmp_path) as (cluster, client):
        put_paced(client, keys)
        wait_for(lambda: metric(cluster, "kvpool_master_ssd_offloads") >= 8, SSD_WAIT_S, "offloads")
        disk_only = [k for k in keys if [r["tier"] for r in cluster.admin(
            "/query_key", key=k).json()["replicas"]] == ["SSD"]]
        assert disk_only  # the admin view does not load them, as a get would
        cluster.add_node("64MiB")
        cluster.wait_segments(3)
        node = cluster.nodes[0]
        (ssd,) = [s for s in cluster.segments() if s["tier"] == "SSD"]
        done = subprocess.run([sys.executable, "-m", "kvpool", "store-node", "drain",
                               str(ssd["endpoint"]), "--master", cluster.address],
                              env=python_env(), capture_output=True, text=True, timeout=120,
                              check=False)
        assert done.returncode == 0, done.stdout + done.stderr
        node.kill()
        node.wait()
        for key in keys:
            got = client.get(key)
            assert got.code == E.OK and got.data == content(key, SIZE), key
        assert client.stats.checksum_mismatches == 0
