"""The master's HTTP sides with a token: admin listings and metadata writes need it, health
and metrics stay open; /integrity is rate-limited; a busy port leaks nothing."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from kvpool.errors import StoreError
from kvpool.store.client.rpc import RpcClient
from kvpool.store.master.server import MasterServer, MasterServerConfig
from kvpool.store.wire.protocol import Op
from tests.support.net import free_port
from tests.support.procs import python_env

TOKEN = "admin-secret"
GUARDED = ["/keys", "/query_key?key=k", "/segments", "/get_all_segments", "/integrity"]


@pytest.fixture
def master() -> Iterator[MasterServer]:
    config = MasterServerConfig(rpc_port=0, admin_port=0, metadata_port=0, token=TOKEN)
    with MasterServer(config) as m:
        with RpcClient(m.address, "node", token=TOKEN) as node:
            node.call_unchecked(Op.MOUNT, "127.0.0.1:7000", 4096, 1 << 20, 1)
            node.call_unchecked(Op.PUT_START, ["k"], [10], 1, False, False, [], False)
            node.call_unchecked(Op.PUT_END, ["k"])
        yield m


def _get(master: MasterServer, path: str, token: str | None = None) -> httpx.Response:
    headers = {"authorization": f"Bearer {token}"} if token else None
    return httpx.get(f"http://127.0.0.1:{master.admin_port}{path}", headers=headers, timeout=5)


@pytest.mark.parametrize("path", GUARDED)
def test_listings_need_the_token(master: MasterServer, path: str) -> None:
    for token in (None, "wrong"):
        response = _get(master, path, token)
        assert response.status_code == 401
        assert "Authorization: Bearer <token>" in response.json()["detail"]
    assert _get(master, path, TOKEN).status_code == 200


def test_health_and_metrics_stay_open(master: MasterServer) -> None:
    assert _get(master, "/health").json()["keys"] == 1
    assert "kvpool_master_keys 1.0" in _get(master, "/metrics").text
    assert _get(master, "/keys", TOKEN).json()["keys"] == ["k"]
    assert _get(master, "/docs").status_code == 404


def test_integrity_holds_the_lock_at_most_a_tenth_of_the_time(
        master: MasterServer, monkeypatch: pytest.MonkeyPatch) -> None:
    assert _get(master, "/integrity", TOKEN).json()["status"] == "ok"
    assert _get(master, "/integrity", TOKEN).json()["status"] == "ok"  # cheap: no wait
    check = master.core.check_integrity

    def slow_check() -> None:
        time.sleep(0.3)
        check()

    monkeypatch.setattr(master.core, "check_integrity", slow_check)
    with ThreadPoolExecutor(2) as pool:   # one run at a time
        first = pool.submit(_get, master, "/integrity", TOKEN)
        time.sleep(0.1)
        second = pool.submit(_get, master, "/integrity", TOKEN)
        codes = sorted([first.result().status_code, second.result().status_code])
    assert codes == [200, 429]
    again = _get(master, "/integrity", TOKEN)   # the next one waits 9 x 0.3 s
    assert again.status_code == 429 and "at most 10% of the time" in again.json()["detail"]
    assert int(again.headers["retry-after"]) >= 2


def test_embedded_metadata_writes_need_the_token(master: MasterServer) -> None:
    assert master._metadata is not None
    url = master._metadata.url
    assert httpx.put(url, params={"key": "a"}, content=b"v").status_code == 401
    assert httpx.put(url, params={"key": "a"}, content=b"v",
                     headers={"authorization": f"Bearer {TOKEN}"}).status_code == 200
    assert httpx.get(url, params={"key": "a"}).content == b"v"


def test_without_a_token_everything_is_open() -> None:
    config = MasterServerConfig(rpc_port=0, admin_port=0, enable_http_metadata=False,
                                token=None)
    with MasterServer(config) as master:
        for path in GUARDED[:-1]:
            assert _get(master, path).status_code in (200, 404)


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
            sock.listen()
        except OSError:
            return False
    return True


def test_busy_admin_port_leaks_no_rpc_socket() -> None:
    rpc = free_port()
    with socket.create_server(("127.0.0.1", 0)) as busy:
        config = MasterServerConfig(rpc_port=rpc, admin_port=busy.getsockname()[1],
                                    enable_http_metadata=False, token=None)
        with pytest.raises(StoreError, match="admin HTTP cannot listen on .*in use"):
            MasterServer(config).start()
    assert _bindable(rpc)


def test_busy_metadata_port_leaks_nothing() -> None:
    rpc, admin = free_port(), free_port()
    with socket.create_server(("127.0.0.1", 0)) as busy:
        config = MasterServerConfig(rpc_port=rpc, admin_port=admin, token=None,
                                    metadata_port=busy.getsockname()[1])
        with pytest.raises(Exception, match="cannot listen"):
            MasterServer(config).start()
    assert _bindable(rpc) and _bindable(admin)


@pytest.mark.parametrize("which", ["--rpc-port", "--admin-port", "--metadata-port"])
def test_cli_busy_port_is_one_clear_line(which: str) -> None:
    ports = {"--rpc-port": free_port(), "--admin-port": free_port(),
             "--metadata-port": free_port()}
    with socket.create_server(("127.0.0.1", 0)) as busy:
        ports[which] = busy.getsockname()[1]
        argv = [x for flag, port in ports.items() for x in (flag, str(port))]
        out = subprocess.run([sys.executable, "-m", "kvpool", "master", *argv],
                             capture_output=True, text=True, timeout=60, env=python_env())
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert f"cannot listen on 127.0.0.1:{ports[which]}" in lines[0]
    assert "in use" in lines[0]
