"""Child processes and ports on this host: the helpers every launcher and benchmark shares."""

from __future__ import annotations

import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


def free_port(host: str = "127.0.0.1") -> int:
    """A port the kernel considers free right now (another process may still take it)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def wait_port(port: int, host: str = "127.0.0.1", timeout_s: float = 20.0) -> None:
    """Until something accepts connections on host:port; TimeoutError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host, port), timeout=0.5).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing accepts on {host}:{port} after {timeout_s}s") from None
            time.sleep(0.05)


def stop(proc: subprocess.Popen[Any], timeout_s: float = 10.0,
         sig: int = signal.SIGTERM) -> None:
    """`sig` (SIGTERM), then SIGKILL if it has not exited within `timeout_s`; reaps it."""
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextmanager
def running(cmd: list[str], timeout_s: float = 10.0, **popen: Any) -> Iterator[subprocess.Popen[Any]]:
    """A child process for the duration of a `with` block (stdout discarded unless given)."""
    popen.setdefault("stdout", subprocess.DEVNULL)
    proc = subprocess.Popen(cmd, **popen)
    try:
        yield proc
    finally:
        stop(proc, timeout_s)
