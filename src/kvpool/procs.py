"""Child processes and ports on this host: the helpers every launcher and benchmark shares (a
child that dies with its parent, `Command` and `spawn_command`, stopping one or its group)."""

from __future__ import annotations

import ctypes
import errno
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_PR_SET_PDEATHSIG = 1

_PICK = random.SystemRandom()  # forked processes must not pick the same sequence
_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_HANDED_OUT: set[int] = set()
"""Ports free_port returned in this process."""
PICK_SPAN = 8192
"""free_port picks among this many ports just below the kernel's ephemeral range."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing is bound to right now, picked at random just below the kernel's
    ephemeral range: every outgoing connection takes its local port from that range, so a
    port picked inside it can be taken by one before the caller binds it (seen in the test
    suite as EADDRINUSE). Another process calling free_port still can take it, with odds of
    about one in PICK_SPAN; this process never gets the same port twice (a launcher picks
    every child's port before any child binds it)."""
    low = _ephemeral_low()
    for _ in range(64):
        port = _PICK.randrange(max(1024, low - PICK_SPAN), low)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            _HANDED_OUT.add(port)
            return port
    with socket.socket() as sock:  # that span is crowded: any port the kernel gives
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def check_ports(host: str, ports: dict[str, int]) -> None:
    """KvpoolError naming the first of `ports` (flag -> port; 0 = any) that cannot be bound on
    `host`: taken by another server (another cluster, whose servers would answer this one's
    readiness checks), or a host this machine does not have."""
    from kvpool.errors import KvpoolError

    for flag, port in ports.items():
        if not port:
            continue
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
            except OSError as exc:
                why = exc.strerror or str(exc)
                if exc.errno == errno.EADDRINUSE:
                    raise KvpoolError(f"{host}:{port} is in use ({why}): is another kvpool up "
                                      f"running? Stop it, or choose another port with {flag}"
                                      ) from exc
                raise KvpoolError(f"cannot listen on {host}:{port} ({why}): check --host "
                                  f"and {flag}") from exc


def _ephemeral_low() -> int:
    try:
        return int(_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


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


def stop_group(proc: subprocess.Popen[Any], timeout_s: float = 10.0) -> None:
    """`stop` for a child that leads a session of its own (start_new_session), and whatever
    it started there (a vLLM server's engine processes): SIGTERM to the group, SIGKILL to what
    is left of it once the leader has exited or `timeout_s` has passed."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        pass
    stop(proc, timeout_s)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def kvpool_argv(*args: str) -> list[str]:
    """The command line of `python -m kvpool ARGS` in this interpreter, warnings and up only."""
    return [sys.executable, "-m", "kvpool", "--log-level", "WARNING", *args]


@contextmanager
def running(cmd: list[str], timeout_s: float = 10.0, **popen: Any) -> Iterator[subprocess.Popen[Any]]:
    """A child process for the duration of a `with` block (stdout discarded unless given)."""
    popen.setdefault("stdout", subprocess.DEVNULL)
    proc = subprocess.Popen(cmd, **popen)
    try:
        yield proc
    finally:
        stop(proc, timeout_s)


def die_with_parent(parent_pid: int) -> Callable[[], None]:
    """A `preexec_fn`: SIGTERM this child when the process that forked it exits. libc is
    looked up here, before the fork, so the child only makes the one system call."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux: the parent's cleanup must do
        return lambda: None

    def set_pdeathsig() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os._exit(1)

    return set_pdeathsig


@dataclass(frozen=True)
class Command:
    """A child's command line, what it adds to this process's environment, and the file its
    output goes to (None: stdout discarded or shown, stderr shown)."""

    argv: tuple[str, ...]
    env: Mapping[str, str] | None = None
    log: Path | None = None


def spawn_command(command: Command, quiet: bool = True) -> subprocess.Popen[bytes]:
    """`command` as a child that dies with this process, in a session of its own."""
    env = None if command.env is None else {**os.environ, **command.env}
    if command.log is not None:
        with open(command.log, "ab") as out:
            return subprocess.Popen(command.argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                    preexec_fn=die_with_parent(os.getpid()),
                                    start_new_session=True)
    return subprocess.Popen(command.argv, stdout=subprocess.DEVNULL if quiet else None, env=env,
                            preexec_fn=die_with_parent(os.getpid()), start_new_session=True)
