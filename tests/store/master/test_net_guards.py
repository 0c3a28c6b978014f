"""No request can stop the master's RPC loop: bad ranges are refused, bugs are answered with
INTERNAL_ERROR, and /health reports a loop that stopped turning."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from kvpool.errors import RpcError
from kvpool.store.client.rpc import RpcClient
from kvpool.store.config import MasterConfig
from kvpool.store.master.server import MasterServer, MasterServerConfig
from kvpool.store.master.service import INTERNAL_ERROR
from kvpool.store.wire.framing import FrameDecoder, encode_frame
from kvpool.store.wire.protocol import Op, decode_reply, encode_request

TOP = 1 << 64


@pytest.fixture
def master() -> Iterator[MasterServer]:
    config = MasterServerConfig(rpc_port=0, admin_port=0, enable_http_metadata=False,
                                token=None, health_stall_s=0.5)
    with MasterServer(config, MasterConfig(max_batch=4)) as m:
        yield m


def _health(master: MasterServer) -> httpx.Response:
    return httpx.get(f"http://127.0.0.1:{master.admin_port}/health", timeout=5)


@pytest.mark.parametrize(("base", "size"), [(TOP - 4096, 1 << 20), (TOP - (1 << 20), 1 << 20),
                                            (0, 0), (0, -1), (0, 1 << 51), (-1, 4096)])
def test_mount_outside_the_address_space_is_refused(master: MasterServer, base: int,
                                                    size: int) -> None:
    with RpcClient(master.address, "node") as node:
        assert node.call_unchecked(Op.MOUNT, "127.0.0.1:7000", base, size, 1) == [-600, ""]
        for _ in range(2):   # formerly: an address past 2**64 killed the RPC thread here
            assert node.call_unchecked(Op.PUT_START, ["k"], [4096], 1, False, False, [], False) \
                == [[-200, []]]
        assert node.call_unchecked(Op.PING) == "pong"
    assert _health(master).status_code == 200


def test_highest_mount_that_fits_is_served(master: MasterServer) -> None:
    with RpcClient(master.address, "node") as node:
        code, sid = node.call_unchecked(Op.MOUNT, "127.0.0.1:7000", TOP - (1 << 20) - 1, 1 << 20, 1)
        assert code == 0
        res = node.call_unchecked(Op.PUT_START, ["a", "b"], [4096, 4096], 1, False, False, [], False)
        assert [r[0] for r in res] == [0, 0]
        assert all(r[1][0][2] + 4096 < TOP for r in res)


@pytest.mark.parametrize("tier", [0, 3, -1])
def test_mount_with_an_unknown_tier_is_refused(master: MasterServer, tier: int) -> None:
    with RpcClient(master.address, "node") as node:
        with pytest.raises(RpcError, match="code -600.*unknown tier"):
            node.call_unchecked(Op.MOUNT, "127.0.0.1:7000", 4096, 4096, tier)
        assert node.call_unchecked(Op.PING) == "pong"


def test_a_bug_in_a_handler_is_an_internal_error_not_invalid_params(
        master: MasterServer, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(keys: list[Any]) -> list[int]:
        raise TypeError("a bug")

    monkeypatch.setattr(master.core, "exists", broken)
    with RpcClient(master.address, "w") as w:
        for _ in range(3):
            with pytest.raises(RpcError, match=f"code {INTERNAL_ERROR}.*internal error"):
                w.call_unchecked(Op.EXISTS, ["k"])
        assert w.call_unchecked(Op.PING) == "pong"
    metrics = httpx.get(f"http://127.0.0.1:{master.admin_port}/metrics").text
    assert 'kvpool_master_errors_total{code="INTERNAL_ERROR",op="EXISTS"} 3.0' in metrics


def test_a_reply_that_cannot_be_encoded_is_answered(master: MasterServer,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(master.core, "exists", lambda keys: [TOP + 1 for _ in keys])
    with RpcClient(master.address, "w") as w:
        with pytest.raises(RpcError, match=f"code {INTERNAL_ERROR}.*could not be encoded"):
            w.call_unchecked(Op.EXISTS, ["k"])
        assert w.call_unchecked(Op.PING) == "pong"


def test_an_error_outside_the_service_drops_one_connection_only(
        master: MasterServer, monkeypatch: pytest.MonkeyPatch) -> None:
    handle = master.service.handle

    def fragile(frame: bytes) -> bytes:
        if b"poison" in frame:
            raise RuntimeError("a bug in the driver's path")
        return handle(frame)

    monkeypatch.setattr(master.service, "handle", fragile)
    bystander = RpcClient(master.address, "b")
    assert bystander.call_unchecked(Op.PING) == "pong"
    with RpcClient(master.address, "poison", timeout_s=2) as victim:
        with pytest.raises(RpcError):
            victim.call_unchecked(Op.PING)
    assert bystander.call_unchecked(Op.PING) == "pong"
    bystander.close()
    assert _health(master).status_code == 200


def test_a_request_over_max_batch_is_refused_with_a_code(master: MasterServer) -> None:
    sock = socket.create_connection(("127.0.0.1", master.rpc_port), timeout=5)
    sock.sendall(encode_frame(encode_request(Op.EXISTS, 9, "w", ["a", "b", "c", "d", "e"])))
    sock.sendall(encode_frame(encode_request(Op.PING, 10, "w")))
    decoder, frames = FrameDecoder(), []
    while len(frames) < 2:
        frames += decoder.feed(sock.recv(65536))
    first, second = (decode_reply(f) for f in frames)
    assert (first.req_id, first.status, first.result) == (9, -600, "batch of 5 keys exceeds 4")
    assert (second.req_id, second.status, second.result) == (10, 0, "pong")
    sock.close()


def test_health_reports_a_stalled_rpc_loop(master: MasterServer) -> None:
    assert _health(master).json()["status"] == "ok"
    with master.lock:         # the loop blocks on the lock at its next tick
        time.sleep(1.0)
        stalled = _health(master)
    assert stalled.status_code == 503
    assert "has not turned" in stalled.json()["reason"]
    assert _health(master).status_code == 200


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_health_reports_a_dead_rpc_loop(master: MasterServer,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    rpc = master._rpc
    assert rpc is not None
    died = threading.Event()

    def fatal() -> None:
        died.set()
        raise SystemExit("the loop thread ends")

    monkeypatch.setattr(rpc, "_turn", fatal)
    rpc._wake_w.send(b"x")
    assert died.wait(5)
    time.sleep(0.2)
    dead = _health(master)
    assert dead.status_code == 503
    assert dead.json() == {"status": "unhealthy", "reason": "the RPC loop is not running"}
