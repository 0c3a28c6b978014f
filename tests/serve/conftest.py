"""A real serving cluster for the proxy tests, started once per session by `kvpool up` itself:
master, store node, two prefill and one decode `kvpool worker` on a tiny model, and `kvpool
proxy`, all separate processes on loopback. At the end of the session `kvpool up` is killed
with SIGKILL and the teardown asserts that none of its children is left (they carry an
environment marker, found by scanning /proc)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvpool.launch.children import spawn, stop
from kvpool.launch.ports import free_port
from kvpool.launch.wait import wait_for, wait_http
from kvpool.serve.launch import ServingCluster, ensure_tiny_model
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
def cluster(tiny_model: Path, cache_home: Path,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServingCluster]:
    marker = f"up-{uuid.uuid4().hex}"
    port = free_port()
    log = tmp_path_factory.mktemp("up") / "up.log"
    with log.open("w") as out:
        # token-less, so that tests can call its workers directly (the token kvpool up makes
        # by default is tested in test_up_serving.py)
        proc = kvpool_up(marker, cache_home, "--port", str(port), "--dram", "64MiB",
                         "--prefill", "2", "--no-token", stdout=out)
    try:
        wait_ready(proc, f"http://127.0.0.1:{port}", log)
        yield parse_up_output(log.read_text(), tiny_model)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert wait_gone(marker) == [], "children of a SIGKILLed `kvpool up` were left running"


def parse_up_output(text: str, model: Path) -> ServingCluster:
    proxy = re.search(r"OpenAI API\s+(\S+)/v1", text)
    master = re.search(r"store master\s+(\S+)\s+\(metadata (\S+)\)", text)
    assert proxy and master, text
    c = ServingCluster("127.0.0.1", proxy.group(1), model, model.name, master.group(1),
                       master.group(2))
    for role, urls in re.findall(r"^\s+(prefill|decode|both)\s+workers\s+(.+)$", text, re.M):
        c.worker_urls[role] = urls.split()
    return c


def wait_ready(proc: subprocess.Popen[str], url: str, log: Path | None = None,
               timeout_s: float = 120) -> None:
    """Until the proxy answers /health and `kvpool up` has printed its banner to `log`;
    KvpoolError with the log as soon as it exits, TimeoutError after `timeout_s`."""

    def ready() -> bool:
        try:
            healthy = httpx.get(url + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False
        return healthy and (log is None or "try: curl" in log.read_text())

    wait_for(ready, timeout_s, lambda: f"kvpool up to be ready: {log.read_text() if log else ''}",
             0.2, procs=[proc])


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
    return [p for p in pids if pid_alive(p)]


def child_pid(marker: str, command: str) -> int:
    """The one process marked `marker` whose `kvpool` arguments hold `command` ("store-node",
    "worker --role decode")."""
    found = []
    for pid in marked_pids(marker):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                argv = fh.read().decode().rstrip("\0").split("\0")
        except OSError:
            continue
        if argv[1:3] == ["-m", "kvpool"] and f" {command} " in f" {' '.join(argv[3:])} ":
            found.append(pid)
    assert len(found) == 1, (command, found)
    return found[0]


def pid_alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_gone(marker: str, timeout_s: float = 30.0) -> list[str]:
    """[] once no process marked `marker` is left, else (after `timeout_s`) what each left
    is (pid, state, command line), each then killed."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        left = marked_pids(marker)
        if not left:
            return []
        time.sleep(0.2)
    left = marked_pids(marker)
    described = [_described(pid) for pid in left]
    for pid in left:  # never leave them behind, even when the test fails
        os.kill(pid, signal.SIGKILL)
    return described


def _described(pid: int) -> str:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        wchan = Path(f"/proc/{pid}/wchan").read_text()
    except OSError:
        return f"{pid} (gone)"
    return f"{pid} state {state} in {wchan or '?'}: {argv[:300]}"


def kvpool_up(marker: str, cache_home: Path, *args: str,
              stdout: Any = subprocess.PIPE) -> subprocess.Popen[str]:
    """`kvpool up ARGS` with `marker` in its environment (inherited by every child), on the
    tiny model unless ARGS name one."""
    env = python_env() | {"KVPOOL_TEST_MARKER": marker, "XDG_CACHE_HOME": str(cache_home)}
    model = () if "--model" in args else ("--model", "tiny")
    return subprocess.Popen([sys.executable, "-m", "kvpool", "up", *model, *args], env=env,
                            stdout=stdout, stderr=subprocess.STDOUT, text=True)


def reap(proc: subprocess.Popen[str], marker: str) -> None:
    """Kill `kvpool up` if it is still running; none of its children may be left."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    assert wait_gone(marker) == []


def token_header(text: str) -> dict[str, str]:
    """The bearer header of the token a `kvpool up` made (its banner names the file)."""
    found = re.search(r"export KVPOOL_TOKEN=\$\(cat (\S+)\)", text)
    assert found, text
    return {"Authorization": f"Bearer {Path(found.group(1)).read_text().strip()}"}
