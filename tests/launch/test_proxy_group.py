"""`kvpool proxy --workers N` in real processes: N proxies accept on one port in front of a real
emulated worker and answer exactly as one does; SIGTERM stops them all (exit 0); one that dies
stops the others (exit 1, so a supervisor starts the proxy again); what cannot be shared is
refused before anything starts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest

from kvpool.bench.proc_cpu import child_pids
from kvpool.bench.proxy_cluster import start_proxy, start_worker
from kvpool.launch.proxy_group import child_argv
from kvpool.launch.wait import wait_for
from tests.support.procs import python_env

Worker = tuple[subprocess.Popen[bytes], int, Path]


@pytest.fixture(scope="module")
def worker() -> Iterator[Worker]:
    with ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
        proc, port = start_worker(stack, Path(tmp), 1000.0)
        yield proc, port, Path(tmp)


def group(stack: ExitStack, worker: Worker) -> tuple[subprocess.Popen[bytes], str]:
    proc, port, tmp = worker
    proc, proxy_port, _ = start_proxy(stack, tmp, proc, port, 1000.0, flags=("--workers", "2"))
    url = f"http://127.0.0.1:{proxy_port}"
    wait_for(lambda: len(child_pids(proc.pid)) == 2, 30, "the group's two processes")
    return proc, url


def answer(url: str) -> str:
    with httpx.Client(timeout=30) as client:  # a new connection each time
        r = client.post(url + "/v1/completions", json={
            "model": "emulated-model", "prompt": "the pool keeps every block", "max_tokens": 8,
            "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["text"])


def test_two_processes_serve_one_port_and_stop_on_sigterm(worker: Worker) -> None:
    with ExitStack() as stack:
        proc, url = group(stack, worker)
        children = child_pids(proc.pid)
        answers = {answer(url) for _ in range(12)}
        assert len(answers) == 1  # the same greedy answer whichever process took it
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        for pid in children:
            wait_for(lambda pid=pid: not Path(f"/proc/{pid}").exists()
                     or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2], 15,
                     f"proxy process {pid} to exit")


def test_one_process_that_dies_stops_the_group(worker: Worker) -> None:
    with ExitStack() as stack:
        proc, url = group(stack, worker)
        answer(url)
        victim, other = child_pids(proc.pid)
        os.kill(victim, signal.SIGKILL)
        assert proc.wait(30) == 1
        assert not Path(f"/proc/{other}").exists() or \
            Path(f"/proc/{other}/stat").read_text().split()[2] == "Z"


def test_kv_events_with_several_processes_is_refused_before_anything_starts() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvpool", "proxy", "--model", "tiny", "--backend", "vllm",
         "--colocated", "http://127.0.0.1:1", "--kv-events", "tcp://127.0.0.1:1",
         "--workers", "2"], capture_output=True, text=True, timeout=120, env=python_env())
    assert out.returncode == 2 and "--kv-events" in out.stderr, out.stderr


def test_the_processes_command_lines_carry_the_groups_flags_and_no_ready_pipe() -> None:
    argv = ["--log-level", "INFO", "--ready-fd", "7", "proxy", "--port", "8000", "--workers",
            "3", "--ready-fd=9"]
    got = child_argv(argv, 1, 3, 5, "/tmp/d")
    assert got[:3] == [sys.executable, "-m", "kvpool"]
    assert got[3:] == ["--log-level", "INFO", "proxy", "--port", "8000", "--workers", "3",
                       "--workers", "1", "--listen-fd", "5", "--peer-dir", "/tmp/d",
                       "--peer-index", "1", "--num-peers", "3"]
