"""A master out of file descriptors neither spins nor floods its log, and serves again once
the flood is gone."""

from __future__ import annotations

import os
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from kvpool.store.client.rpc import RpcClient
from kvpool.store.wire.protocol import Op
from tests.support.net import free_port, wait_port
from tests.support.procs import python_env, stop

FD_LIMIT = 96


def _limit_fds() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (FD_LIMIT, FD_LIMIT))


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _flood(port: int, count: int) -> list[socket.socket]:
    socks = []
    for _ in range(count):
        sock = socket.socket()
        sock.setblocking(False)
        sock.connect_ex(("127.0.0.1", port))
        socks.append(sock)
    return socks


def test_descriptor_flood_is_survived(tmp_path: Path) -> None:
    rpc, admin, meta = free_port(), free_port(), free_port()
    log_path = tmp_path / "master.log"
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvpool", "master", "--rpc-port", str(rpc),
             "--admin-port", str(admin), "--metadata-port", str(meta)],
            env=python_env(), stdout=subprocess.DEVNULL, stderr=log_file,
            preexec_fn=_limit_fds)
    try:
        wait_port(rpc), wait_port(admin), wait_port(meta)
        with RpcClient(f"127.0.0.1:{rpc}", "steady", timeout_s=5) as steady:
            assert steady.call_unchecked(Op.PING) == "pong"
            flood = _flood(meta, 2 * FD_LIMIT)
            time.sleep(1.0)
            waiting = socket.create_connection(("127.0.0.1", rpc), timeout=5)  # can't be accepted
            log_before, cpu_before = log_path.stat().st_size, _cpu_s(proc.pid)
            time.sleep(3.0)
            cpu_used = _cpu_s(proc.pid) - cpu_before
            log_grown = log_path.stat().st_size - log_before
            assert steady.call_unchecked(Op.PING) == "pong"   # connections already open are served
            assert cpu_used < 1.0, f"master used {cpu_used:.2f} CPU-s in 3 s while out of fds"
            assert log_grown < 64 << 10, f"log grew by {log_grown} bytes in 3 s"
            for sock in (*flood, waiting):
                sock.close()
        deadline = time.monotonic() + 15
        while True:
            try:
                with RpcClient(f"127.0.0.1:{rpc}", "after", timeout_s=2) as after:
                    assert after.call_unchecked(Op.PING) == "pong"
                break
            except Exception:
                assert time.monotonic() < deadline, "the master did not serve again"
                time.sleep(0.2)
        url = f"http://127.0.0.1:{meta}/metadata"
        assert httpx.put(url, params={"key": "k"}, content=b"v", timeout=5).status_code == 200
        assert httpx.get(f"http://127.0.0.1:{admin}/health", timeout=5).status_code == 200
        assert proc.poll() is None
    finally:
        stop(proc)


def _rss_mib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) // 1024 for line in f if line.startswith("VmRSS"))


def test_a_client_that_never_reads_cannot_make_the_master_queue_replies_without_bound() -> None:
    """One send of 23,000 small requests, each answered with a 300-segment table (17 KB), on
    a connection that reads nothing: the master holds a few MiB of replies for it, not the
    400 MB they come to, and the other clients are served meanwhile."""
    from contextlib import ExitStack

    from kvpool.launch.store import start_master
    from kvpool.store.wire.framing import encode_frame
    from kvpool.store.wire.protocol import encode_request

    with ExitStack() as stack:
        proc, address, _ = start_master(stack)
        good = stack.enter_context(RpcClient(address, "good"))
        for i in range(300):
            good.call_unchecked(Op.MOUNT, f"127.0.0.1:{7000 + i}", 1 << 30, 1 << 20, 1)
        before = _rss_mib(proc.pid)
        burst = b"".join(encode_frame(encode_request(Op.SEGMENTS, i + 1, "hog"))
                         for i in range(23_000))
        host, port = address.rsplit(":", 1)
        hog = stack.enter_context(socket.create_connection((host, int(port))))
        hog.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        hog.setblocking(False)
        try:
            hog.send(burst)
        except BlockingIOError:
            pass
        started = time.monotonic()
        good.call_unchecked(Op.PING, timeout_s=30)
        assert time.monotonic() - started < 1.5
        time.sleep(0.5)
        assert _rss_mib(proc.pid) - before < 40, "replies queued without bound"
