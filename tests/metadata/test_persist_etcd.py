"""`kvpool metadata --etcd`: every change reaches a real etcd before the reply, and a server
restarted (after SIGKILL) on the same etcd and prefix serves every acknowledged key; with etcd
gone, writes are refused (503) and nothing changes."""

from __future__ import annotations

import subprocess
import sys
import uuid
from contextlib import ExitStack

import httpx
import pytest

from kvpool.errors import MetadataError
from kvpool.launch.etcd import EtcdProcess
from kvpool.metadata.etcd_mirror import EtcdMirroredBackend
from kvpool.metadata.server import MetadataServer
from kvpool.metadata.uri import parse_etcd_endpoints
from tests.support.net import free_port, wait_port
from tests.support.procs import python_env


def start(etcd: str, prefix: str, port: int) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-m", "kvpool", "metadata", "--port", str(port),
                             "--etcd", etcd, "--etcd-prefix", prefix], env=python_env(),
                            text=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    wait_port(port, timeout_s=30)
    return proc


def test_restarted_server_serves_every_key_from_etcd(etcd_endpoint: str) -> None:
    prefix, port = f"/test/{uuid.uuid4().hex}/", free_port()
    url = f"http://127.0.0.1:{port}/metadata"
    proc = start(etcd_endpoint, prefix, port)
    try:
        for i in range(10):
            assert httpx.put(url, params={"key": f"seg/{i}"}, content=bytes([i]) * 50).is_success
        assert httpx.delete(url, params={"key": "seg/4"}).status_code == 200
        proc.kill()
        proc.wait()
        proc = start(etcd_endpoint, prefix, port)
        for i in range(10):
            got = httpx.get(url, params={"key": f"seg/{i}"})
            expected = (404, None) if i == 4 else (200, bytes([i]) * 50)
            assert (got.status_code, got.content if got.status_code == 200 else None) == expected
    finally:
        proc.kill()
        proc.wait()


def test_without_etcd_a_write_is_refused_and_memory_unchanged() -> None:
    with ExitStack() as stack:
        etcd = EtcdProcess(stack).start()
        store = EtcdMirroredBackend(parse_etcd_endpoints(etcd.endpoint), "/t/")
        store.put("a", b"1")
        server = stack.enter_context(MetadataServer(port=0, backend=store))
        etcd.kill()
        refused = httpx.put(server.url, params={"key": "b"}, content=b"2")
        assert refused.status_code == 503 and "metadata not stored" in refused.text
        assert httpx.delete(server.url, params={"key": "a"}).status_code == 503
        with pytest.raises(MetadataError):
            store.put("b", b"2")
        with pytest.raises(MetadataError):
            store.delete("a")
        assert store.get("a") == b"1" and store.get("b") is None
        etcd.start()
        store.put("b", b"2")
        assert EtcdMirroredBackend(parse_etcd_endpoints(etcd.endpoint), "/t/").keys() == \
            ["a", "b"]
        store.close()


def test_both_backings_at_once_is_a_clear_error(tmp_path: object) -> None:
    out = subprocess.run([sys.executable, "-m", "kvpool", "metadata", "--port", "0",
                          "--state-file", "x", "--etcd", "127.0.0.1:1"], env=python_env(),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "give --state-file or --etcd, not both" in out.stderr


def test_reads_are_served_from_memory_while_a_write_waits_on_a_hung_etcd() -> None:
    """etcd stopped (SIGSTOP: it takes connections and answers nothing): a write waits out
    its timeout and is refused, and meanwhile reads of what the server holds answer at once
    (the write neither holds the readers' lock nor the event loop)."""
    import os
    import signal
    import threading
    import time

    from kvpool.metadata import connect_metadata

    with ExitStack() as stack:
        etcd = EtcdProcess(stack, "hung").start()
        port = free_port()
        proc = start(etcd.endpoint, f"/test/{uuid.uuid4().hex}/", port)
        stack.callback(proc.wait)
        stack.callback(proc.kill)
        url = f"http://127.0.0.1:{port}/metadata"
        writer = connect_metadata(url, timeout_s=30.0, token="")
        reader = connect_metadata(url, timeout_s=2.0, token="")
        writer.put("seg/a", b"a")
        assert etcd.proc is not None
        os.kill(etcd.proc.pid, signal.SIGSTOP)
        stack.callback(os.kill, etcd.proc.pid, signal.SIGCONT)
        refused: list[BaseException] = []

        def write() -> None:
            try:
                writer.put("seg/b", b"b")
            except MetadataError as exc:
                refused.append(exc)
        thread = threading.Thread(target=write)
        thread.start()
        time.sleep(0.3)                               # the write waits on etcd
        started = time.monotonic()
        assert reader.get("seg/a") == b"a"
        assert time.monotonic() - started < 1.0
        thread.join(30)
        assert len(refused) == 1 and "503" in str(refused[0])
