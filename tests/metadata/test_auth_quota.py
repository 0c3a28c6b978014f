"""The HTTP metadata server against hostile clients: writes need the token, stored values and
bodies in flight share one quota, and connections are bounded in number and idle time."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from kvpool.bench.attacks import closed_by_peer
from kvpool.errors import MetadataError
from kvpool.metadata import MetadataClientConfig, connect_metadata
from kvpool.metadata.http_client import HttpMetadataBackend
from kvpool.metadata.http_serving import HttpLimits, descriptor_cap, limits_for_descriptors
from kvpool.metadata.server import MetadataLimits, MetadataServer
from tests.support.net import free_port, wait_port
from tests.support.procs import running, spawn_kvpool
from tests.support.wait import wait_for

TOKEN = "meta-secret"


@pytest.fixture(scope="module")
def guarded() -> Iterator[MetadataServer]:
    limits = MetadataLimits(max_value_bytes=600, max_total_bytes=1000)
    with MetadataServer(port=0, limits=limits, token=TOKEN) as server:
        yield server


def _auth(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


@pytest.mark.parametrize("headers", [{}, _auth("wrong"), {"authorization": TOKEN},
                                     {"authorization": f"Basic {TOKEN}"}])
def test_writes_without_the_token_are_401(guarded: MetadataServer,
                                          headers: dict[str, str]) -> None:
    for method in ("PUT", "DELETE"):
        response = httpx.request(method, guarded.url, params={"key": "w/k"}, content=b"v",
                                 headers=headers)
        assert response.status_code == 401
        assert response.headers["www-authenticate"] == "Bearer"
        assert "Authorization: Bearer <token>" in response.text
    assert guarded.backend.get("w/k") is None


def test_writes_with_the_token_and_open_reads(guarded: MetadataServer) -> None:
    url = guarded.url
    assert httpx.put(url, params={"key": "r/k"}, content=b"v", headers=_auth(TOKEN)) \
        .status_code == 200
    assert httpx.get(url, params={"key": "r/k"}).content == b"v"   # reads need no token
    assert httpx.delete(url, params={"key": "r/k"}, headers=_auth(TOKEN)).status_code == 200


def test_client_sends_its_token(guarded: MetadataServer) -> None:
    with HttpMetadataBackend(guarded.url, MetadataClientConfig(token=TOKEN)) as client:
        client.put("c/k", b"v")
        assert client.get("c/k") == b"v"
        assert client.delete("c/k")
    anonymous = connect_metadata(guarded.url, token="")
    assert anonymous is not None
    with anonymous, pytest.raises(MetadataError, match="answered 401"):
        anonymous.put("c/k", b"v")


def test_token_comes_from_the_environment(guarded: MetadataServer,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPOOL_TOKEN", TOKEN)
    client = connect_metadata(guarded.url)
    assert client is not None
    with client:
        client.put("e/k", b"v")
        assert client.delete("e/k")


def test_total_quota_is_507(guarded: MetadataServer) -> None:
    with HttpMetadataBackend(guarded.url, MetadataClientConfig(token=TOKEN)) as client:
        client.put("q/a", b"a" * 600)
        with pytest.raises(MetadataError, match="answered 507.*full"):
            client.put("q/b", b"b" * 600)
        assert client.get("q/b") is None
        client.put("q/a", b"A" * 600)                 # replacing a value frees its bytes
        client.put("q/c", b"c" * 400)
        assert guarded.backend.total_bytes == 1000
        assert client.delete("q/a") and client.delete("q/c")
        client.put("q/b", b"b" * 600)
        assert client.delete("q/b")
    assert guarded.backend.total_bytes == 0


def test_silent_connections_are_closed() -> None:
    with MetadataServer(port=0, http_limits=HttpLimits(idle_timeout_s=0.3)) as server:
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        start = time.monotonic()
        assert sock.recv(1) == b""                  # the server hung up on a silent peer
        assert time.monotonic() - start < 3
        sock.close()


def test_concurrency_is_limited() -> None:
    """Connections waiting for a request give way to a new one; busy ones get 503."""
    limits = HttpLimits(max_concurrency=3, body_idle_s=60)  # bodies pending: busy here
    with MetadataServer(port=0, http_limits=limits) as server:
        idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(3)]
        time.sleep(0.2)
        assert httpx.get(server.url, params={"key": "x"}).status_code == 404
        for sock in idle:
            sock.close()
        busy = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(3)]
        for sock in busy:     # a request whose body never comes: in progress
            sock.sendall(b"PUT /metadata?key=b HTTP/1.1\r\nhost: x\r\n"
                         b"content-length: 100\r\n\r\n")
        wait_for(lambda: httpx.get(server.url, params={"key": "x"}).status_code == 503, 10.0,
                 "busy connections to fill the limit (the server read the three heads)", 0.05)
        for sock in busy:
            sock.close()
        time.sleep(0.2)
        assert httpx.get(server.url, params={"key": "x"}).status_code == 404


def test_bodies_stalled_past_their_idle_limit_give_way_at_the_limit() -> None:
    """A body that has not advanced for body_idle_s holds its descriptor no better than a
    trickled head: at the limit it is closed for a new connection."""
    limits = HttpLimits(max_concurrency=3, idle_timeout_s=30, body_idle_s=1.0)
    with MetadataServer(port=0, http_limits=limits) as server:
        stalled = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(3)]
        for sock in stalled:
            sock.sendall(b"PUT /metadata?key=b HTTP/1.1\r\nhost: x\r\n"
                         b"content-length: 100\r\n\r\nxx")
        time.sleep(1.3)
        assert httpx.get(server.url, params={"key": "x"}, timeout=5).status_code == 404
        assert sum(closed_by_peer(sock) for sock in stalled) >= 1
        for sock in stalled:
            sock.close()


def test_the_connection_cap_stays_within_the_descriptors() -> None:
    assert descriptor_cap(1024) == 768 and descriptor_cap(100) == 36 and descriptor_cap(10) == 8
    assert limits_for_descriptors(HttpLimits(max_concurrency=1024), 1024).max_concurrency == 768
    assert limits_for_descriptors(HttpLimits(max_concurrency=256), 1024).max_concurrency == 256


def test_trickled_request_heads_are_cut_off_and_cannot_lock_clients_out() -> None:
    limits = HttpLimits(max_concurrency=4, idle_timeout_s=0.5, head_timeout_s=1.0)
    with MetadataServer(port=0, http_limits=limits) as server:
        slow = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(6)]
        start, closed = time.monotonic(), set()
        while len(closed) < len(slow) and time.monotonic() - start < 5:
            for i, sock in enumerate(slow):   # one byte of a head every 0.2 s
                try:
                    sock.sendall(b"G")
                except OSError:
                    closed.add(i)
            assert httpx.get(server.url, params={"key": "x"}).status_code == 404
            time.sleep(0.2)
        assert len(closed) == len(slow) and time.monotonic() - start < 3
        for sock in slow:
            sock.close()


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def test_concurrent_large_puts_stay_within_the_quota() -> None:
    port = free_port()
    with running(spawn_kvpool("metadata", "--port", str(port), "--token", TOKEN)) as proc:
        wait_port(port)
        before = _rss_bytes(proc.pid)
        body = b"x" * (16 << 20)
        codes: list[int] = []

        def put(i: int) -> None:
            try:
                codes.append(httpx.put(f"http://127.0.0.1:{port}/metadata",
                                       params={"key": f"big/{i}"}, content=body,
                                       headers=_auth(TOKEN), timeout=30).status_code)
            except httpx.HTTPError:
                codes.append(-1)   # refused mid-body: the server closed the connection

        threads = [threading.Thread(target=put, args=(i,)) for i in range(24)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        grown = _rss_bytes(proc.pid) - before
        assert codes.count(200) == 4            # 4 x 16 MiB fill the 64 MiB quota
        assert grown < 160 << 20, f"RSS grew by {grown >> 20} MiB"   # formerly +385 MiB
