"""`kvpool up` as the serving cluster: it serves, its demo runs, and it leaves no process behind
after SIGTERM or even SIGKILL of `kvpool up` itself (children found by an environment marker
in /proc)."""

from __future__ import annotations

import signal
import subprocess
import time
import uuid
from pathlib import Path

import httpx

from kvpool.serve.launch import free_port
from tests.serve.conftest import kvpool_up, marked_pids, wait_gone


def _wait_ready(proc: subprocess.Popen[str], url: str, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError("kvpool up did not become ready")


def _serve_then_signal(cache_home: Path, sig: signal.Signals) -> None:
    marker = f"up-{uuid.uuid4().hex}"
    port = free_port()
    proc = kvpool_up(marker, cache_home, "--port", str(port))
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_ready(proc, url)
        assert len(marked_pids(marker)) >= 6  # up, master, store node, 2 workers, proxy
        out = httpx.post(url + "/v1/completions", timeout=60,
                         json={"model": "tiny", "prompt": "hello", "max_tokens": 4})
        assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] >= 1
        proc.send_signal(sig)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert wait_gone(marker) == []


def test_up_serves_and_sigterm_stops_everything(cache_home: Path) -> None:
    _serve_then_signal(cache_home, signal.SIGTERM)


def test_sigkill_of_up_still_stops_every_child(cache_home: Path) -> None:
    _serve_then_signal(cache_home, signal.SIGKILL)


def test_up_demo_streams_and_shows_prefix_reuse(cache_home: Path) -> None:
    marker = f"up-{uuid.uuid4().hex}"
    proc = kvpool_up(marker, cache_home, "--port", str(free_port()), "--demo")
    try:
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out
    assert "demo: completion 'The cache block pool' -> " in out
    assert "TTFT cold" in out and "same prefix again" in out
    assert "demo: done" in out
    assert "curl http://127.0.0.1:" in out
    assert wait_gone(marker) == []
