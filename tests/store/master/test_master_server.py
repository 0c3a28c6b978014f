"""The master as a real process and as an in-process server: RPC over TCP, admin HTTP."""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Iterator

import httpx
import msgpack
import pytest

from kvpool.errors import RpcError, RpcTimeout
from kvpool.store.client.rpc import RpcClient
from kvpool.store.master.server import MasterServer, MasterServerConfig
from kvpool.store.wire.codes import ErrorCode as E
from kvpool.store.wire.framing import FrameDecoder, encode_frame
from kvpool.store.wire.protocol import Op, decode_reply, encode_request
from tests.support.net import free_port, wait_port
from tests.support.procs import running, spawn_kvpool
from tests.support.wait import wait_for


@pytest.fixture
def master() -> Iterator[MasterServer]:
    with MasterServer(MasterServerConfig(rpc_port=0, admin_port=0,
                                         enable_http_metadata=False)) as m:
        yield m


def test_rpc_and_admin_in_process(master: MasterServer) -> None:
    with RpcClient(master.address, "node") as node, RpcClient(master.address, "w") as w:
        assert node.call_unchecked(Op.PING) == "pong"
        code, sid = node.call_unchecked(Op.MOUNT, "127.0.0.1:7000", 4096, 1 << 20, 1)
        assert (code, sid) == (0, "127.0.0.1:7000/1000")
        res = w.call_unchecked(Op.PUT_START, ["k1", "k2"], [10, 5000], 1, False, False, [], False)
        assert res == [[0, [[sid, "127.0.0.1:7000", 4096, 10, 1, 1, 0]]],
                       [0, [[sid, "127.0.0.1:7000", 4096 + 64, 5000, 1, 1, 0]]]]
        assert w.call_unchecked(Op.PUT_END, ["k1", "k2"]) == [0, 0]
        assert w.call_unchecked(Op.EXISTS, ["k1", "nope"]) == [0, -704]
    base = f"http://127.0.0.1:{master.admin_port}"
    assert httpx.get(f"{base}/health").json()["keys"] == 2
    segs = httpx.get(f"{base}/segments").json()
    assert segs == [{"segment_id": sid, "client_id": "node", "endpoint": "127.0.0.1:7000",
                     "base_addr": 4096, "capacity_bytes": 1 << 20, "used_bytes": 5120,
                     "tier": "DRAM", "draining": False}]
    q = httpx.get(f"{base}/query_key", params={"key": "k2"}).json()
    assert q["size"] == 5000 and q["replicas"][0]["addr"] == 4160
    assert httpx.get(f"{base}/query_key", params={"key": "zz"}).status_code == 404
    assert httpx.get(f"{base}/keys", params={"prefix": "k"}).json()["keys"] == ["k1", "k2"]
    metrics = httpx.get(f"{base}/metrics").text
    assert "kvpool_master_keys 2.0" in metrics
    assert 'kvpool_master_ops_total{op="PUT_START"} 1.0' in metrics
    assert f'kvpool_master_used_bytes{{segment="{sid}",tier="DRAM"}} 5120.0' in metrics
    assert "kvpool_master_rpc_seconds_bucket" in metrics


def _raw(master: MasterServer) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", master.rpc_port), timeout=5)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _read_frames(sock: socket.socket, count: int) -> list[bytes]:
    decoder, frames = FrameDecoder(), []
    while len(frames) < count:
        data = sock.recv(65536)
        assert data, "the master closed the connection"
        frames += decoder.feed(data)
    assert decoder.buffered_bytes == 0
    return frames


def _at_eof(sock: socket.socket) -> bool:
    try:
        return sock.recv(65536) == b""
    except ConnectionResetError:
        return True


BAD_FRAMES = (b"\x00garbage", msgpack.packb([int(Op.GET_REPLICAS), 4, "c", ["", "a b"]]), b"")


def test_garbage_over_the_socket_then_service_continues(master: MasterServer) -> None:
    whole = _raw(master)   # two kinds of sender: whole frames in one write, and a trickle
    for frame in BAD_FRAMES:
        whole.sendall(encode_frame(frame))
    trickle = _raw(master)
    for byte in b"".join(encode_frame(f) for f in BAD_FRAMES):
        trickle.send(bytes([byte]))
    for sock in (whole, trickle):
        replies = [decode_reply(f) for f in _read_frames(sock, 3)]
        assert [(r.req_id, r.status) for r in replies] == [
            (0, E.INVALID_PARAMS), (4, 0), (0, E.INVALID_PARAMS)]
        assert replies[1].result == [10.0, [[-600, 0, [], 0.0, None], [-600, 0, [], 0.0, None]]]
        sock.close()
    truncated = _raw(master)                     # half a header, then half a frame, then gone
    truncated.sendall(encode_frame(BAD_FRAMES[1])[:2])
    truncated.close()
    truncated = _raw(master)
    truncated.sendall(encode_frame(BAD_FRAMES[1])[:9])
    truncated.close()
    with RpcClient(master.address, "w") as w:
        assert w.call_unchecked(Op.GET_REPLICAS, ["", "x"]) == [10.0, [[-600, 0, [], 0.0, None],
                                                            [-704, 0, [], 0.0, None]]]
        with pytest.raises(RpcError, match="code -600"):
            w.call_unchecked(Op.MOUNT, "x", 0, 1)   # wrong arity
        metrics = httpx.get(f"http://127.0.0.1:{master.admin_port}/metrics").text
        assert 'kvpool_master_errors_total{code="INVALID_PARAMS",op="malformed"} 5.0' in metrics
        assert 'kvpool_master_key_errors_total{code="INVALID_PARAMS",op="GET_REPLICAS"} 5.0' \
            in metrics
        assert 'kvpool_master_key_errors_total{code="OBJECT_NOT_FOUND",op="GET_REPLICAS"} 1.0' \
            in metrics


def test_pipelined_requests_are_answered_in_order(master: MasterServer) -> None:
    sock = _raw(master)
    requests = [encode_request(Op.EXISTS, i, "p", [f"k{i}"]) for i in range(1, 201)]
    sock.sendall(b"".join(encode_frame(r) for r in requests))
    replies = [decode_reply(f) for f in _read_frames(sock, 200)]
    assert [(r.req_id, r.status, r.result) for r in replies] == [
        (i, 0, [-704]) for i in range(1, 201)]
    sock.close()


def test_rpc_timeout_when_no_master() -> None:
    with RpcClient(f"127.0.0.1:{free_port()}", "w", timeout_s=0.2) as w:
        with pytest.raises(RpcTimeout):
            w.call_unchecked(Op.PING)


def test_cli_master_with_mooncake_flags() -> None:
    rpc, admin, meta = free_port(), free_port(), free_port()
    proc = spawn_kvpool("master", "--rpc_port", str(rpc), "--metrics_port", str(admin),
                        "--enable_http_metadata_server", "true",
                        "--http_metadata_server_port", str(meta),
                        "--default_kv_lease_ttl", "500", "--client_ttl", "3",
                        "--eviction_high_watermark_ratio", "0.8", "--eviction_ratio", "0.1")
    with running(proc):
        wait_port(rpc), wait_port(admin), wait_port(meta)
        assert httpx.get(f"http://127.0.0.1:{admin}/health").json()["status"] == "ok"
        assert httpx.put(f"http://127.0.0.1:{meta}/metadata", params={"key": "a"},
                         content=b"v").status_code == 200
        with RpcClient(f"127.0.0.1:{rpc}", "w") as w:
            w.call_unchecked(Op.MOUNT, "127.0.0.1:7000", 0, 4096, 1)
            w.call_unchecked(Op.PUT_START, ["k"], [1], 1, False, False, [], False)
            w.call_unchecked(Op.PUT_END, ["k"])
            assert w.call_unchecked(Op.GET_REPLICAS, ["k"])[0] == 0.5
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
            segs = wait_for(lambda: httpx.get(f"http://127.0.0.1:{admin}/segments").json(),
                            30.0, "a segment mounted", 0.1)
            assert [s["capacity_bytes"] for s in segs] == [4 << 20]
    assert node.returncode == 0


def test_oversized_frame_drops_that_peer_only(master: MasterServer) -> None:
    bystander = RpcClient(master.address, "b")
    assert bystander.call_unchecked(Op.PING) == "pong"
    sock = _raw(master)
    sock.sendall(struct.pack("<I", (64 << 20) + 1) + b"\x00" * 1000)  # over the 64 MiB limit
    reply = decode_reply(_read_frames(sock, 1)[0])
    assert (reply.req_id, reply.status) == (0, E.INVALID_PARAMS)
    assert reply.result == f"frame of {(64 << 20) + 1} bytes exceeds {64 << 20}"
    assert _at_eof(sock)                       # then the master hangs up on that peer
    sock.close()
    assert bystander.call_unchecked(Op.PING) == "pong"   # same connection, still served
    bystander.close()
    with RpcClient(master.address, "w") as w:
        assert w.call_unchecked(Op.PING) == "pong"
        assert w.call_unchecked(Op.EXISTS, ["k" * 4097, "k"]) == [-600, -704]


def test_a_client_that_does_not_read_stalls_only_itself(master: MasterServer) -> None:
    with RpcClient(master.address, "node") as node:
        for i in range(100):
            assert node.call_unchecked(Op.MOUNT, f"127.0.0.1:{7000 + i}", 0, 1 << 20, 1)[0] == 0
        sock = _raw(master)       # ~1,500 replies of ~9 KB: far more than the socket buffers
        sock.sendall(b"".join(encode_frame(encode_request(Op.SEGMENTS, i, "s"))
                              for i in range(1, 1501)))
        time.sleep(0.3)
        assert node.call_unchecked(Op.PING, timeout_s=2) == "pong"
        replies = [decode_reply(f) for f in _read_frames(sock, 1500)]
        assert [r.req_id for r in replies] == list(range(1, 1501))
        assert all(r.status == 0 and len(r.result) == 100 for r in replies)
        sock.close()
        assert node.call_unchecked(Op.PING) == "pong"


@pytest.mark.slow  # 11 s
def test_store_node_whose_master_is_gone_stops_promptly_on_sigterm() -> None:
    """With its master killed, a node's unmount cannot be answered: SIGTERM still ends it
    within a few seconds (close_timeout_s), not after one RPC timeout per call."""
    rpc, admin = free_port(), free_port()
    master = spawn_kvpool("master", "--rpc_port", str(rpc), "--metrics_port", str(admin),
                          "--no-http-metadata")
    with running(master):
        wait_port(admin)
        node = spawn_kvpool("store-node", "--dram", "4MiB", "--master", f"127.0.0.1:{rpc}")
        with running(node):
            wait_for(lambda: httpx.get(f"http://127.0.0.1:{admin}/segments").json(), 30.0,
                     "the node to mount", 0.1)
            master.kill()
            master.wait(10)
            time.sleep(1.5)                     # heartbeats now fail
            started = time.monotonic()
            node.terminate()
            assert node.wait(8) == 0
            assert time.monotonic() - started < 6
