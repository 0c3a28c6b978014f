"""A real serving cluster for the proxy tests: master, store node, one prefill and one decode
`kvpool worker` on a tiny model, and `kvpool proxy`, all separate processes on loopback,
started once per session the way `kvpool up` starts them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvpool.serve.launch import (
    ServingCluster,
    ServingSpec,
    ensure_tiny_model,
    free_port,
    serving_cluster,
    spawn,
    stop,
    wait_http,
)
from tests.support.procs import python_env


@pytest.fixture(scope="session")
def cache_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An XDG cache holding the tiny model where `kvpool up` looks for it."""
    home = tmp_path_factory.mktemp("cache")
    ensure_tiny_model(home / "kvpool" / "models" / "tiny")
    return home


@pytest.fixture(scope="session")
def tiny_model(cache_home: Path) -> Path:
    return cache_home / "kvpool" / "models" / "tiny"


@pytest.fixture(scope="session")
def cluster(tiny_model: Path) -> Iterator[ServingCluster]:
    spec = ServingSpec(tiny_model, port=free_port(), dram="64MiB")
    with serving_cluster(spec) as c:
        yield c


@pytest.fixture
def proxy_url(cluster: ServingCluster) -> str:
    return cluster.proxy_url


def start_proxy(model: Path, *args: str,
                ready: str = "/health") -> tuple[subprocess.Popen[bytes], str]:
    """Another `kvpool proxy` over existing workers, once `ready` answers 200; the caller
    stops it."""
    port = free_port()
    proc = spawn("proxy", "--model", str(model), "--port", str(port), *args)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + ready, [proc], "proxy", timeout_s=60)
    except BaseException:
        stop(proc)
        raise
    return proc, url


def start_worker(model: Path, role: str, cluster: ServingCluster) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    master = cluster.master_address
    proc = spawn("worker", "--role", role, "--model", str(model), "--host", "127.0.0.1",
                 "--port", str(port), "--master", master)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/health", [proc], f"{role} worker", timeout_s=60)
    except BaseException:
        stop(proc)
        raise
    return proc, url


def sse_events(resp: httpx.Response) -> list[dict[str, object] | str]:
    """Every `data:` payload of an SSE body: parsed JSON, or the string "[DONE]"."""
    out: list[dict[str, object] | str] = []
    for line in resp.iter_lines():
        if line.startswith("data: "):
            payload = line[6:]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def marked_pids(marker: str) -> list[int]:
    """Processes whose environment holds `marker` (found by scanning /proc, no psutil)."""
    needle = marker.encode()
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as fh:
                if needle in fh.read():
                    pids.append(int(entry))
        except OSError:
            continue
    return [p for p in pids if _alive(p)]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_gone(marker: str, timeout_s: float = 30.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        left = marked_pids(marker)
        if not left:
            return []
        time.sleep(0.2)
    left = marked_pids(marker)
    for pid in left:  # never leave them behind, even when the test fails
        os.kill(pid, signal.SIGKILL)
    return left


def kvpool_up(marker: str, cache_home: Path, *args: str) -> subprocess.Popen[str]:
    env = python_env() | {"KVPOOL_TEST_MARKER": marker, "XDG_CACHE_HOME": str(cache_home)}
    return subprocess.Popen([sys.executable, "-m", "kvpool", "up", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
