"""Child processes for multi-process tests: real interpreters, killed on exit (`kvpool`
children started by kvpool.launch, as `kvpool up` and the benchmarks start theirs)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager

from kvpool.launch import children
from kvpool.launch import store as launch_store
from tests.support.wait import wait_for


def python_env() -> dict[str, str]:
    env = dict(os.environ)
    src = os.path.join(os.path.dirname(__file__), "..", "..", "src")
    env["PYTHONPATH"] = os.path.abspath(src) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("KVPOOL_LOG_LEVEL", "WARNING")
    return env


def spawn_python(code: str, *args: str, stdout: int | None = subprocess.PIPE) -> subprocess.Popen[bytes]:
    """Start `python -c code args...` with kvpool importable; stdin is a pipe for control."""
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        stdin=subprocess.PIPE,
        stdout=stdout,
        stderr=None,
        env=python_env(),
    )


def spawn_kvpool(*args: str) -> subprocess.Popen[bytes]:
    """Start the `kvpool` CLI as a user would, in its own process, through kvpool's own
    launcher (a child that dies with the test process), its output the test's."""
    return launch_store.spawn_kvpool(*args, quiet=False, log_level="WARNING")


def proc_state(pid: int) -> str:
    """The one-letter state of process `pid` in /proc (R, S, T for stopped, Z...)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def wait_stopped(pid: int, timeout_s: float = 10.0) -> None:
    """Until process `pid` is stopped (after SIGSTOP), or TimeoutError."""
    wait_for(lambda: proc_state(pid) == "T", timeout_s, f"process {pid} to stop", step_s=0.01)


def stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM, timeout_s: float = 10.0) -> None:
    children.stop(proc, timeout_s, sig)


@contextmanager
def running(proc: subprocess.Popen[bytes]) -> Iterator[subprocess.Popen[bytes]]:
    try:
        yield proc
    finally:
        stop(proc)
