"""Multi-process tests: a master, store nodes and clients, each in its own process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable

import pytest

from kvpool.store.client.config import ClientConfig
from kvpool.store.client.store_client import StoreClient
from kvpool.store.config import ReplicateConfig
from kvpool.store.wire.codes import ErrorCode as E
from tests.store.cluster import Cluster, content, store_cluster
from tests.support.procs import spawn_python
from tests.support.wait import wait_for

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
WORKER = f"""
import sys
sys.path.insert(0, {ROOT!r})
from tests.store.workload import main
main(sys.argv[1:])
"""


def start_workers(cluster: Cluster, num: int, num_ops: int, replicas: int,
                  seconds: float = 0.0) -> list[subprocess.Popen[bytes]]:
    """Workload processes doing `num_ops` operations each, or running for `seconds`."""
    procs = [spawn_python(WORKER, cluster.address, str(w), str(num_ops), str(replicas),
                          str(seconds)) for w in range(num)]
    for p in procs:
        assert p.stdout is not None and p.stdout.readline().strip() == b"ready"
    for p in procs:
        assert p.stdin is not None
        p.stdin.write(b"go\n")
        p.stdin.flush()
    return procs


def collect(procs: list[subprocess.Popen[bytes]], timeout_s: float = 120) -> list[dict]:  # type: ignore[type-arg]
    out = []
    for p in procs:
        stdout, _ = p.communicate(timeout=timeout_s)
        assert p.returncode == 0
        out.append(json.loads(stdout.decode().strip().splitlines()[-1]))
    return out


def verify_all(cluster: Cluster, acked: dict[str, int]) -> None:
    with StoreClient(ClientConfig(master=cluster.address)) as store:
        keys = sorted(acked)
        for i in range(0, len(keys), 64):
            chunk = keys[i:i + 64]
            for key, got in zip(chunk, store.get_batch(chunk), strict=True):
                assert got.code == E.OK, (key, got.code)
                assert got.data == content(key, acked[key]), key


def test_clients_in_other_processes_share_objects() -> None:
    with store_cluster(2, "32MiB") as cluster:
        (result,) = collect(start_workers(cluster, 1, 200, 2))
        assert result["stats"]["bad_reads"] == 0
        assert len(result["acked"]) > 50
        verify_all(cluster, result["acked"])
        cluster.check_integrity()
        segs = cluster.segments()
        assert sorted(s["capacity_bytes"] for s in segs) == [32 << 20, 32 << 20]


@pytest.mark.slow  # 21 s: the default suite keeps the two-process sharing case
def test_eight_concurrent_clients_mixed_operations() -> None:
    with store_cluster(2, "64MiB") as cluster:
        results = collect(start_workers(cluster, 8, 1000, 2), timeout_s=170)
        acked: dict[str, int] = {}
        for r in results:
            assert r["stats"] == {"bad_reads": 0, "lost_own": 0, "ops": 1000}, r
            assert set(r["codes"]) <= {"put:OK", "get:OK", "get:OBJECT_NOT_FOUND",
                                       "remove:OK", "remove:OBJECT_HAS_LEASE"}, r["codes"]
            acked.update(r["acked"])
        cluster.check_integrity()
        assert cluster.admin("/health").json()["keys"] == len(acked)
        verify_all(cluster, acked)
        cluster.check_integrity()


def test_kill_store_node_replicated_survive_unreplicated_vanish() -> None:
    with store_cluster(2, "16MiB", "--client_ttl", "1") as cluster:
        victim, survivor = cluster.segments()
        with StoreClient(ClientConfig(master=cluster.address, transfer_timeout_s=2.0)) as store:
            both = ReplicateConfig(replica_num=2)
            on_victim = ReplicateConfig(preferred_segment=str(victim["endpoint"]))
            for i in range(40):
                assert store.put(f"r{i}", content(f"r{i}", 3000 + i), both).ok
                assert store.put(f"u{i}", content(f"u{i}", 2000 + i), on_victim).ok
            assert {r.endpoint for r in store.replica_desc("u0").replicas} == \
                {victim["endpoint"]}
            victim_proc = next(p for p in cluster.nodes
                               if str(p.pid) in str(victim["client_id"]))
            victim_proc.send_signal(signal.SIGKILL)
            victim_proc.wait()
            for i in range(40):                 # before the master notices
                got = store.get(f"r{i}")
                assert got.code == E.OK and got.data == content(f"r{i}", 3000 + i)
                got = store.get(f"u{i}")
                assert got.code in (E.OK, E.TRANSFER_FAIL)
                if got.ok:
                    assert got.data == content(f"u{i}", 2000 + i)
            cluster.wait_segments(1, timeout_s=10)
            for i in range(40):
                assert store.get(f"u{i}").code == E.OBJECT_NOT_FOUND
                got = store.get(f"r{i}")
                assert got.code == E.OK and got.data == content(f"r{i}", 3000 + i)
                assert [r.endpoint for r in store.replica_desc(f"r{i}").replicas] == \
                    [survivor["endpoint"]]
            assert store.put("after", b"x" * 100, both).code == E.NO_AVAILABLE_HANDLE
            assert store.put("after", b"x" * 100).ok
        cluster.check_integrity()


@pytest.mark.slow  # 12 s; test_kill_store_node_replicated_survive_unreplicated_vanish stays
def test_kill_store_node_mid_workload() -> None:
    with store_cluster(2, "64MiB", "--client_ttl", "1") as cluster:
        procs = start_workers(cluster, 3, 0, 2, seconds=4.0)
        time.sleep(0.5)
        assert all(p.poll() is None for p in procs), "workers finished before the kill"
        cluster.nodes[0].send_signal(signal.SIGKILL)
        results = collect(procs)
        acked: dict[str, int] = {}
        failed_puts = 0
        for r in results:
            assert r["stats"]["bad_reads"] == 0
            acked.update(r["acked"])
            failed_puts += sum(n for c, n in r["codes"].items()
                               if c.startswith("put:") and c != "put:OK")
        assert failed_puts > 0, "the kill did not land during the workload"
        cluster.wait_segments(1, timeout_s=10)
        verify_all(cluster, acked)
        cluster.check_integrity()


def test_full_pool_is_a_clear_no_space_result() -> None:
    with store_cluster(1, "1MiB") as cluster:
        with StoreClient(ClientConfig(master=cluster.address)) as store:
            pinned = ReplicateConfig(with_hard_pin=True)
            codes = [store.put(f"p{i}", b"z" * 100_000, pinned).code for i in range(12)]
            assert codes[:10] == [E.OK] * 10
            assert codes[10:] == [E.NO_AVAILABLE_HANDLE] * 2
            assert store.put("big", b"z" * (2 << 20)).code == E.NO_AVAILABLE_HANDLE
            assert store.get("p3").data == b"z" * 100_000
        cluster.check_integrity()


@pytest.mark.parametrize("flags", [("--default_kv_lease_ttl", "300",
                                    "--put_start_discard_timeout_sec", "0.5")])
def test_short_real_lease_and_pending_timeouts(flags: tuple[str, ...]) -> None:
    from kvpool.store.client.rpc import RpcClient
    from kvpool.store.wire.protocol import Op
    with store_cluster(1, "4MiB", *flags) as cluster:
        with StoreClient(ClientConfig(master=cluster.address)) as store:
            assert store.put("k", b"v" * 10).ok
            assert store.get("k").ok
            assert store.remove("k") == E.OBJECT_HAS_LEASE
            time.sleep(0.4)
            assert store.remove("k") == E.OK
        with RpcClient(cluster.address, "stuck") as rpc:
            assert rpc.call_unchecked(Op.PUT_START, ["p"], [64], 1, False, False, [], False)[0][0] == 0
            assert "kvpool_master_pending_puts 1.0" in cluster.admin("/metrics").text
            time.sleep(0.9)
            assert "kvpool_master_pending_puts 0.0" in cluster.admin("/metrics").text
            assert rpc.call_unchecked(Op.PUT_END, ["p"]) == [int(E.OBJECT_NOT_FOUND)]
        cluster.check_integrity()


def test_watermark_eviction_in_a_running_master() -> None:
    with store_cluster(1, "2MiB", "--eviction_high_watermark_ratio", "0.5",
                       "--eviction_ratio", "0.25") as cluster:
        with StoreClient(ClientConfig(master=cluster.address)) as store:
            for i in range(14):                      # 14 x 100 KB = 1.4 MB > 50 % of 2 MiB
                assert store.put(f"e{i}", content(f"e{i}", 100_000)).ok
            wait_for(lambda: cluster.admin("/health").json()["used_bytes"] <= 1 << 20, 5.0,
                     lambda: f"eviction to 1 MiB: {cluster.admin('/health').json()}", 0.05)
            metrics = cluster.admin("/metrics").text
            assert "kvpool_master_evicted_objects_total 0.0" not in metrics
            assert store.get("e0").code == E.OBJECT_NOT_FOUND      # least recently used
            assert store.get("e13").data == content("e13", 100_000)
        cluster.check_integrity()


@pytest.mark.parametrize("verify", [True, False])
def test_each_object_of_a_batch_read_is_held_to_its_own_lease(verify: bool) -> None:
    """A batch read in which one object's lease is short (a copy loaded from disk gets
    `transient_lease_s`; here the lookup's lease is cut for "b"), and runs out before the
    copy while "b" is removed and its memory taken by another put: "b" answers
    LEASE_EXPIRED (not another object's bytes, not a checksum failure reported as damage),
    "a" its own bytes."""
    with store_cluster(1, "4MiB") as cluster:
        with StoreClient(ClientConfig(master=cluster.address, verify_checksums=verify,
                                      lease_retries=0)) as store:
            a, b = b"A" * 65536, b"B" * 65536
            assert store.put("a", a).ok and store.put("b", b).ok
            lookup, run_copies = store._lookup, store._run_copies

            def short(keys):  # type: ignore[no-untyped-def]
                looks, t0 = lookup(keys)
                return [x._replace(lease_ttl_s=0.05) if k == "b" else x
                        for k, x in zip(keys, looks, strict=True)], t0

            def late(*args, **kw):  # type: ignore[no-untyped-def]
                assert store.remove("b", force=True) == E.OK
                assert store.put("filler", b"F" * 65536).ok
                time.sleep(0.1)
                return run_copies(*args, **kw)

            store._lookup, store._run_copies = short, late  # type: ignore[method-assign]
            got = store.get_batch(["a", "b"])
            assert (got[0].code, got[0].data) == (E.OK, a)
            assert got[1].code == E.LEASE_EXPIRED
            assert store.stats.damaged_dropped == 0


def test_no_replica_is_read_once_an_objects_lease_has_ended() -> None:
    """An object whose lease has ended before its copy (or before a copy from its next
    replica) is not read at all: LEASE_EXPIRED, and no transfer touches its replica."""
    with store_cluster(1, "4MiB") as cluster:
        with StoreClient(ClientConfig(master=cluster.address)) as store:
            assert store.put("a", b"A" * 4096).ok and store.put("b", b"B" * 4096).ok
            lookup, run_copies = store._lookup, store._run_copies
            copied: list[int] = []

            def ended(keys):  # type: ignore[no-untyped-def]
                looks, t0 = lookup(keys)
                return [x._replace(lease_ttl_s=-1.0) if k == "b" else x
                        for k, x in zip(keys, looks, strict=True)], t0

            def counted(op, copies, *args, **kw):  # type: ignore[no-untyped-def]
                copied.extend(copies)
                return run_copies(op, copies, *args, **kw)

            store._lookup, store._run_copies = ended, counted  # type: ignore[method-assign]
            got = store.get_batch(["a", "b"])
            assert (got[0].code, got[0].data) == (E.OK, b"A" * 4096)
            assert got[1].code == E.LEASE_EXPIRED and copied == [0]
            assert store.stats.lease_retries == 2            # looked up twice more, in vain


def _lease_ended_once(store: StoreClient, key: str,
                      then: Callable[[], object] = lambda: None) -> None:
    """Patch `store` so that the first lookup naming `key` grants a lease already over;
    `then` runs right after that lookup."""
    lookup, ended = store._lookup, []

    def once(keys):  # type: ignore[no-untyped-def]
        looks, t0 = lookup(keys)
        if key in keys and not ended:
            ended.append(key)
            looks = [x._replace(lease_ttl_s=-1.0) if k == key else x
                     for k, x in zip(keys, looks, strict=True)]
            then()
        return looks, t0

    store._lookup = once  # type: ignore[method-assign]


def test_a_read_whose_lease_ended_is_looked_up_and_read_again() -> None:
    """A lease that ends before the read (a slow moment, a short lease on a copy loaded from
    disk) is not the caller's failure: the object is looked up and read again."""
    with store_cluster(1, "4MiB") as cluster:
        with StoreClient(ClientConfig(master=cluster.address, early_reads=False)) as store:
            assert store.put("a", b"A" * 4096).ok and store.put("b", b"B" * 8192).ok
            _lease_ended_once(store, "b")
            got = store.get_batch(["a", "b"])
            assert [(g.code, g.data) for g in got] == [(E.OK, b"A" * 4096), (E.OK, b"B" * 8192)]
            assert store.stats.lease_retries == 1
            buf = bytearray(8192)
            reg = store.register_buffer(buf)
            _lease_ended_once(store, "b")
            assert store.get_into("b", reg.addr, 8192).code == E.OK and buf == b"B" * 8192
            assert store.stats.lease_retries == 2


def test_an_object_that_changed_size_meanwhile_is_not_read_again() -> None:
    """The bytes API sized its buffer for the first lookup: an object upserted to another
    size while its lease ran out answers LEASE_EXPIRED, never a buffer's stale tail."""
    with store_cluster(1, "4MiB") as cluster:
        with StoreClient(ClientConfig(master=cluster.address, early_reads=False)) as store:
            assert store.put("b", b"B" * 8192).ok
            _lease_ended_once(store, "b", then=lambda: (store.remove("b", force=True),
                                                        store.put("b", b"b" * 4096)))
            assert store.get("b").code == E.LEASE_EXPIRED
            assert store.get("b").data == b"b" * 4096
