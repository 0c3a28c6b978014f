"""Faults with real processes on loopback: stalled writers, a stalled or restarted master,
a stalled store node, a corrupted replica. The store may report an error; it must never
hand out wrong bytes as OK, and must lose nothing a stall or restart need not lose."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from kvpool.store.client.config import ClientConfig
from kvpool.store.client.store_client import StoreClient
from kvpool.store.config import ReplicateConfig
from kvpool.store.wire.codes import ErrorCode as E
from kvpool.store.wire.codes import ReplicaDesc
from kvpool.transfer import OpCode, TransferConfig, TransferEngine, TransferRequest
from tests.store.cluster import Cluster, content, store_cluster
from tests.support.procs import running, spawn_python
from tests.support.wait import wait_for

SIZE = 64 << 10

STALLED_WRITER = r"""
import json, sys
from kvpool.store.client.store_client import StoreClient
from kvpool.store.client.config import ClientConfig
from kvpool.store.client.checksum import parts_checksum
from kvpool.store.wire import messages as m
from kvpool.transfer import OpCode

master, metadata, key, size = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
c = StoreClient(ClientConfig(master=master, metadata=metadata, heartbeat_interval_s=0.2,
                             rpc_timeout_s=2.0, protocol=sys.argv[5]))
addr, view, _ = c._staging.acquire(size)
view[:] = b"\xaa" * size                       # A's bytes
((code, wire),) = c._call(m.PutStartMsg(keys=[key], sizes=[size]))
print(json.dumps({"code": int(code), "addrs": [w.addr for w in wire]}), flush=True)
sys.stdin.readline()                           # stalled between PUT_START and the copy
copies = {0: c._copies_to(wire, [(addr, size)], size)}
failed = c._run_copies(OpCode.WRITE, copies)
try:
    ended = [int(e) for e in c._call(m.PutEndMsg(keys=[key],
                                                 checksums=[parts_checksum([(addr, size)], size)]))]
except Exception as exc:
    ended = [repr(exc)]
print(json.dumps({"copied": not failed, "ended": ended}), flush=True)
sys.stdin.readline()
c.close()
"""


@contextmanager
def stalled_writer(cluster: Cluster, key: str,
                   protocol: str = "auto") -> Iterator[subprocess.Popen[bytes]]:
    """A writer that has the master's ranges for `key` and waits for a line to copy (over
    `protocol`: shm or tcp to a same-host node)."""
    with running(spawn_python(STALLED_WRITER, cluster.address, cluster.metadata, key,
                              str(SIZE), protocol)) as proc:
        yield proc


def line(proc: subprocess.Popen[bytes]) -> dict:  # type: ignore[type-arg]
    assert proc.stdout is not None
    return json.loads(proc.stdout.readline())  # type: ignore[no-any-return]


def resume(proc: subprocess.Popen[bytes]) -> dict:  # type: ignore[type-arg]
    """SIGCONT the stalled writer and let it copy; its report."""
    assert proc.stdin is not None
    proc.send_signal(signal.SIGCONT)
    proc.stdin.write(b"go\n")
    proc.stdin.flush()
    return line(proc)


def client(cluster: Cluster, **kw: object) -> StoreClient:
    return StoreClient(ClientConfig(master=cluster.address, metadata=cluster.metadata,
                                    heartbeat_interval_s=0.2, **kw))  # type: ignore[arg-type]


def assert_never_wrong(b: StoreClient, key: str, value: bytes) -> E:
    got = b.get(key)
    assert got.data != b"\xaa" * SIZE, "B's get returned the stalled writer's bytes"
    assert got.code != E.OK or got.data == value
    return got.code


@pytest.mark.parametrize("protocol", ["shm", pytest.param("tcp", marks=pytest.mark.slow)])
def test_stalled_writer_across_a_master_restart_never_overwrites_b(protocol: str) -> None:
    with store_cluster(1, "8MiB", http_metadata=True) as cluster, \
            stalled_writer(cluster, "a", protocol) as writer:
        planned = line(writer)
        assert planned["code"] == 0
        writer.send_signal(signal.SIGSTOP)
        cluster.kill_master()
        cluster.start_master()
        cluster.wait_segments(1, timeout_s=10)
        with client(cluster) as b:
            value = content("b", SIZE)
            assert b.put("b", value).ok
            assert [r.addr for r in b.replica_desc("b").replicas] == planned["addrs"]
            done = resume(writer)
            assert done == {"copied": False,                      # the node changed its fence
                            "ended": [int(E.OBJECT_NOT_FOUND)]}   # and that master is gone
            assert assert_never_wrong(b, "b", value) is E.OK


@pytest.mark.parametrize("protocol", ["shm", "tcp"])
def test_stalled_writer_across_a_node_remount_never_overwrites_b(protocol: str) -> None:
    with store_cluster(1, "8MiB", "--client-ttl", "1.5") as cluster, \
            stalled_writer(cluster, "a", protocol) as writer:
        planned = line(writer)
        assert planned["code"] == 0
        writer.send_signal(signal.SIGSTOP)
        node = cluster.nodes[0]
        node.send_signal(signal.SIGSTOP)
        try:
            wait_for(lambda: cluster.segments() == [], 10, "the master expires the node")
        finally:
            node.send_signal(signal.SIGCONT)
        cluster.wait_segments(1, timeout_s=10)
        with client(cluster) as b:
            value = content("b", SIZE)
            assert b.put("b", value).ok
            done = resume(writer)
            assert done == {"copied": False, "ended": [int(E.OBJECT_NOT_FOUND)]}
            assert assert_never_wrong(b, "b", value) is E.OK
            cluster.check_integrity()


@pytest.mark.slow  # 12 s; the default suite keeps the stalled writer across a restart
def test_master_stall_past_client_ttl_loses_nothing() -> None:
    with store_cluster(2, "8MiB", "--client-ttl", "2") as cluster, client(cluster) as c:
        keys = [f"r{i}" for i in range(16)]
        two = ReplicateConfig(replica_num=2)
        assert all(r.ok for r in c.put_batch(keys, [content(k, 4000) for k in keys], two))
        cluster.master.send_signal(signal.SIGSTOP)
        time.sleep(4.5)
        cluster.master.send_signal(signal.SIGCONT)
        time.sleep(1.0)                          # queued heartbeats are read, nobody expires
        assert len(cluster.segments()) == 2
        assert [g.data for g in c.get_batch(keys)] == [content(k, 4000) for k in keys]
        assert c.put("after", content("after", 4000), two).ok
        assert c.get("after").data == content("after", 4000)
        cluster.check_integrity()


@pytest.mark.slow  # 18 s
def test_master_restart_nodes_mount_and_publish_again_within_seconds() -> None:
    with store_cluster(2, "8MiB", http_metadata=True) as cluster:
        cluster.kill_master()
        t0 = time.monotonic()
        cluster.start_master()
        cluster.wait_segments(2, timeout_s=5)
        assert time.monotonic() - t0 < 8
        with client(cluster) as fresh:             # finds the nodes through the new directory
            value = content("new", 100_000)
            assert fresh.put("new", value, ReplicateConfig(replica_num=2)).ok
            assert fresh.get("new").data == value


def test_a_corrupted_replica_is_never_returned() -> None:
    with store_cluster(2, "8MiB") as cluster, client(cluster) as c, \
            TransferEngine(TransferConfig()) as vandal:
        value = content("x", SIZE)
        assert c.put("x", value, ReplicateConfig(replica_num=2)).ok
        junk = vandal.register(bytearray(b"\x00" * 16))
        first, second = c.replica_desc("x").replicas
        write_fenced(vandal, junk.addr, first)
        assert c.get("x").data == value                         # read from the intact one
        write_fenced(vandal, junk.addr, second)
        assert c.get("x").code == E.CHECKSUM_MISMATCH
        # each damaged replica was read once and dropped: the object left with its last
        assert (c.stats.checksum_mismatches, c.stats.damaged_dropped) == (2, 2)
        assert c.get("x").code == E.OBJECT_NOT_FOUND
        cluster.check_integrity()


def write_fenced(engine: TransferEngine, local: int, replica: ReplicaDesc) -> None:
    """Overwrite 16 bytes of a replica the way a buggy writer of the current mount would
    (it carries the right fence, so only the checksum can tell)."""
    (status,) = engine.transfer_sync([TransferRequest(OpCode.WRITE, local, 16, replica.endpoint,
                                                      replica.addr + 100, replica.fence)])
    assert status.ok, status.reason



def test_an_early_read_from_a_stopped_node_holds_no_other_call() -> None:
    """A get that reads early (store/client/early.py) from a node that is then SIGSTOPped
    waits for that node alone: the client's other calls to the master go on meanwhile, the
    get fails within its transfer timeout (the ordinary read that follows does not wait for
    the same node again), and once the node runs again it serves."""
    with store_cluster(1, "8MiB") as cluster, \
            client(cluster, protocol="tcp", transfer_timeout_s=1.5) as c:
        value = content("k", 4000)
        assert c.put("k", value).ok                    # placed by this client: read early
        (node,) = cluster.nodes
        node.send_signal(signal.SIGSTOP)
        try:
            got: list[object] = []
            thread = threading.Thread(target=lambda: got.append(c.get("k")), daemon=True)
            thread.start()
            started = time.monotonic()
            time.sleep(0.3)                            # the get waits on the node
            t0 = time.monotonic()
            assert c.exists("k") == E.OK and c.exists("other") == E.OBJECT_NOT_FOUND
            assert time.monotonic() - t0 < 0.5
            thread.join(10)
            assert not thread.is_alive() and got[0].code == E.TRANSFER_FAIL  # type: ignore[attr-defined]
            assert time.monotonic() - started < 1.5 * 1.4  # not waited for twice
            assert c.stats.early_reads == 1
        finally:
            node.send_signal(signal.SIGCONT)
        assert c.get("k").data == value


def test_a_get_whose_remembered_node_stopped_reads_the_new_place_at_once() -> None:
    """The key moved (removed, put again on another node) while the node it was read from
    stopped: the master's answer no longer names that place, so the early read's reply is
    given up unread and the get reads the new place at once."""
    with store_cluster(1, "8MiB") as cluster, client(cluster) as writer, \
            client(cluster, protocol="tcp", transfer_timeout_s=3.0) as c:
        old, new = content("old", 4000), content("new", 4000)
        assert writer.put("k", old).ok
        assert c.get("k").data == old                  # c keeps where it found k (node A)
        (first,) = writer.replica_desc("k").replicas
        cluster.add_node("8MiB")
        (second,) = [s["segment_id"] for s in cluster.wait_segments(2)
                     if s["segment_id"] != first.segment_id]
        cluster.nodes[0].send_signal(signal.SIGSTOP)
        try:
            assert writer.remove("k", force=True) == E.OK
            assert writer.put("k", new, ReplicateConfig(preferred_segment=str(second))).ok
            t0 = time.monotonic()
            assert c.get("k").data == new
            assert time.monotonic() - t0 < 1.0
            assert (c.stats.early_reads, c.stats.early_reads_refused) == (1, 1)
        finally:
            cluster.nodes[0].send_signal(signal.SIGCONT)
