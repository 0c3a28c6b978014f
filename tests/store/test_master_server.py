"""The master as a real process and as an in-process server: RPC over zmq, admin HTTP."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import msgpack
import pytest
import zmq

from kvpool.errors import RpcError, RpcTimeout
from kvpool.store.codes import ErrorCode as E
from kvpool.store.master import MasterServer, MasterServerConfig
from kvpool.store.protocol import Op, decode_reply
from kvpool.store.rpc_client import RpcClient
from tests.support.net import free_port, wait_port
from tests.support.procs import running, spawn_kvpool


@pytest.fixture
def master() -> Iterator[MasterServer]:
    with MasterServer(MasterServerConfig(rpc_port=0, admin_port=0,
                                         enable_http_metadata=False)) as m:
        yield m


def test_rpc_and_admin_in_process(master: MasterServer) -> None:
    with RpcClient(master.address, "node") as node, RpcClient(master.address, "w") as w:
        assert node.call(Op.PING) == "pong"
        code, sid = node.call(Op.MOUNT, "127.0.0.1:7000", 4096, 1 << 20, 1)
        assert (code, sid) == (0, "127.0.0.1:7000/1000")
        res = w.call(Op.PUT_START, ["k1", "k2"], [10, 5000], 1, False, False, [], False)
        assert res == [[0, [[sid, "127.0.0.1:7000", 4096, 10, 1, 1]]],
                       [0, [[sid, "127.0.0.1:7000", 4096 + 64, 5000, 1, 1]]]]
        assert w.call(Op.PUT_END, ["k1", "k2"]) == [0, 0]
        assert w.call(Op.EXISTS, ["k1", "nope"]) == [0, -704]
    base = f"http://127.0.0.1:{master.admin_port}"
    assert httpx.get(f"{base}/health").json()["keys"] == 2
    segs = httpx.get(f"{base}/segments").json()
    assert segs == [{"segment_id": sid, "client_id": "node", "endpoint": "127.0.0.1:7000",
                     "base_addr": 4096, "capacity_bytes": 1 << 20, "used_bytes": 5120,
                     "tier": "DRAM"}]
    q = httpx.get(f"{base}/query_key", params={"key": "k2"}).json()
    assert q["size"] == 5000 and q["replicas"][0]["addr"] == 4160
    assert httpx.get(f"{base}/query_key", params={"key": "zz"}).status_code == 404
    assert httpx.get(f"{base}/keys", params={"prefix": "k"}).json()["keys"] == ["k1", "k2"]
    metrics = httpx.get(f"{base}/metrics").text
    assert "kvpool_master_keys 2.0" in metrics
    assert 'kvpool_master_ops_total{op="PUT_START"} 1.0' in metrics
    assert f'kvpool_master_used_bytes{{segment="{sid}",tier="DRAM"}} 5120.0' in metrics
    assert "kvpool_master_rpc_seconds_bucket" in metrics


def test_garbage_over_the_socket_then_service_continues(master: MasterServer) -> None:
    ctx = zmq.Context.instance()
    for kind in (zmq.DEALER, zmq.REQ):
        sock = ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://{master.address}")
        for frame in (b"\x00garbage", msgpack.packb([int(Op.GET_REPLICAS), 4, "c", [1, 2]])):
            sock.send(frame)
            assert sock.poll(5000)
            reply = decode_reply(sock.recv())
            assert reply.status == 0 or reply.status == E.INVALID_PARAMS
        sock.close()
    with RpcClient(master.address, "w") as w:
        assert w.call(Op.GET_REPLICAS, [1, "x"]) == [10.0, [[-600, 0, [], 0.0],
                                                            [-704, 0, [], 0.0]]]
        with pytest.raises(RpcError, match="code -600"):
            w.call(Op.MOUNT, "x", 0, 1)   # wrong arity
        metrics = httpx.get(f"http://127.0.0.1:{master.admin_port}/metrics").text
        assert 'kvpool_master_errors_total{code="INVALID_PARAMS",op="malformed"}' in metrics
        assert 'kvpool_master_key_errors_total{code="INVALID_PARAMS",op="GET_REPLICAS"} 5.0' \
            in metrics
        assert 'kvpool_master_key_errors_total{code="OBJECT_NOT_FOUND",op="GET_REPLICAS"} 1.0' \
            in metrics


def test_rpc_timeout_when_no_master() -> None:
    with RpcClient(f"127.0.0.1:{free_port()}", "w", timeout_s=0.2) as w:
        with pytest.raises(RpcTimeout):
            w.call(Op.PING)


def test_cli_master_with_mooncake_flags() -> None:
    rpc, admin, meta = free_port(), free_port(), free_port()
    proc = spawn_kvpool("master", "--rpc_port", str(rpc), "--metrics_port", str(admin),
                        "--http_metadata_server_port", str(meta),
                        "--default_kv_lease_ttl", "500", "--client_ttl", "3",
                        "--eviction_high_watermark_ratio", "0.8", "--eviction_ratio", "0.1")
    with running(proc):
        wait_port(rpc), wait_port(admin), wait_port(meta)
        assert httpx.get(f"http://127.0.0.1:{admin}/health").json()["status"] == "ok"
        assert httpx.put(f"http://127.0.0.1:{meta}/metadata", params={"key": "a"},
                         content=b"v").status_code == 200
        with RpcClient(f"127.0.0.1:{rpc}", "w") as w:
            w.call(Op.MOUNT, "127.0.0.1:7000", 0, 4096, 1)
            w.call(Op.PUT_START, ["k"], [1], 1, False, False, [], False)
            w.call(Op.PUT_END, ["k"])
            assert w.call(Op.GET_REPLICAS, ["k"])[0] == 0.5
    assert proc.returncode == 0


def test_cli_master_bad_flag_value() -> None:
    proc = spawn_kvpool("master", "--rpc_port", "0", "--metrics_port", "0",
                        "--no-http-metadata", "--eviction_ratio", "7")
    assert proc.wait(30) == 2


def test_store_node_waits_for_a_late_master() -> None:
    rpc, admin = free_port(), free_port()
    node = spawn_kvpool("store-node", "--dram", "4MiB", "--master", f"127.0.0.1:{rpc}")
    with running(node):
        time.sleep(1.0)
        assert node.poll() is None
        master = spawn_kvpool("master", "--rpc_port", str(rpc), "--metrics_port", str(admin),
                              "--no-http-metadata")
        with running(master):
            wait_port(admin)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                segs = httpx.get(f"http://127.0.0.1:{admin}/segments").json()
                if segs:
                    break
                time.sleep(0.1)
            assert [s["capacity_bytes"] for s in segs] == [4 << 20]
    assert node.returncode == 0


def test_oversized_frame_drops_that_peer_only(master: MasterServer) -> None:
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://{master.address}")
    sock.send(b"\x00" * ((64 << 20) + 1))     # over the 64 MiB frame limit
    assert not sock.poll(500)                  # no reply: zmq drops the connection
    sock.close()
    with RpcClient(master.address, "w") as w:
        assert w.call(Op.PING) == "pong"
        assert w.call(Op.EXISTS, ["k" * 4097, "k"]) == [-600, -704]
