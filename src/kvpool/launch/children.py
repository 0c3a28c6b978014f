"""Child processes: a child that dies with its parent (`die_with_parent`), any program as such
a child (`Command`, `spawn_command`), `python -m kvpool ARGS` as one (`spawn`), a child for the
length of a `with` block (`running`), a short one run to its end (`run_to_end`, and
`run_for_output` for what it prints), and stopping one or its process group.

A child of `kvpool up` must not outlive it, however it ends (Ctrl-C, SIGTERM, SIGKILL): every
child spawned here is started with Linux's parent-death signal (`prctl(PR_SET_PDEATHSIG,
SIGTERM)`, set between fork and exec), and exits at once if its parent was already gone by
then. The signal is SIGTERM so that children still clean up (shared-memory segments, sockets).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpool.errors import KvpoolError

_PR_SET_PDEATHSIG = 1
STOP_S = 10.0
"""How long children told to stop (a group of them at once) have before SIGKILL."""


def stop(proc: subprocess.Popen[Any], timeout_s: float = 10.0,
         sig: int = signal.SIGTERM) -> None:
    """`sig` (SIGTERM), then SIGKILL if it has not exited within `timeout_s`; reaps it. A
    stopped child (SIGSTOP) is continued, or it would not act on `sig` before the SIGKILL."""
    if proc.poll() is None:
        proc.send_signal(sig)
        proc.send_signal(signal.SIGCONT)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def stop_group(proc: subprocess.Popen[Any], timeout_s: float = 10.0) -> None:
    """`stop` for a child that leads a session of its own (start_new_session), and whatever
    it started there (a vLLM server's engine processes): SIGTERM to the group, SIGKILL to what
    is left of it once the leader has exited or `timeout_s` has passed."""
    signal_group(proc.pid, signal.SIGTERM, signal.SIGCONT)
    stop(proc, timeout_s)
    signal_group(proc.pid, signal.SIGKILL)


def stop_together(procs: Sequence[subprocess.Popen[Any]],
                  stop_one: Callable[[subprocess.Popen[Any], float], None] = stop_group,
                  timeout_s: float | None = None) -> None:
    """Stop `procs` at once: each still running, and its group if it leads one, is sent
    SIGTERM (and SIGCONT, so a stopped one acts on it) before any is waited for; then each
    is `stop_one`d within what is left of `timeout_s` (STOP_S): the time is theirs together,
    not each one's in turn."""
    for p in procs:
        if p.poll() is None:
            with suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
                p.send_signal(signal.SIGCONT)
            signal_group(p.pid, signal.SIGTERM, signal.SIGCONT)
    deadline = time.monotonic() + (STOP_S if timeout_s is None else timeout_s)
    for p in procs:
        stop_one(p, max(0.1, deadline - time.monotonic()))


def signal_group(pid: int, *sigs: int) -> None:
    """Send `sigs` in turn to the process group `pid` leads, if any is left of it."""
    for sig in sigs:
        try:
            os.killpg(pid, sig)
        except (ProcessLookupError, PermissionError):
            return


def kvpool_argv(*args: str) -> list[str]:
    """The command line of `python -m kvpool ARGS` in this interpreter, warnings and up only."""
    return [sys.executable, "-m", "kvpool", "--log-level", "WARNING", *args]


@contextmanager
def running(cmd: list[str], timeout_s: float = 10.0, **popen: Any) -> Iterator[subprocess.Popen[Any]]:
    """A child process for the duration of a `with` block, dying with this process (stdout
    discarded unless given)."""
    popen.setdefault("stdout", subprocess.DEVNULL)
    popen.setdefault("preexec_fn", die_with_parent(os.getpid()))
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


def spawn_command(command: Command, quiet: bool = True,
                  pass_fds: Sequence[int] = ()) -> subprocess.Popen[bytes]:
    """`command` as a child that dies with this process, in a session of its own; `pass_fds`
    stay open in it (a readiness pipe's write end)."""
    env = None if command.env is None else {**os.environ, **command.env}
    if command.log is not None:
        with open(command.log, "ab") as out:
            return subprocess.Popen(command.argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                    preexec_fn=die_with_parent(os.getpid()),
                                    start_new_session=True, pass_fds=pass_fds)
    return subprocess.Popen(command.argv, stdout=subprocess.DEVNULL if quiet else None, env=env,
                            preexec_fn=die_with_parent(os.getpid()), start_new_session=True,
                            pass_fds=pass_fds)


def run_to_end(argv: Sequence[str]) -> None:
    """A short command run to its end as a child that dies with this process (stdout
    discarded); CalledProcessError when it fails."""
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL,
                   preexec_fn=die_with_parent(os.getpid()))


def run_for_output(argv: Sequence[str], timeout_s: float,
                   env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """A short command run to its end as a child that dies with this process, its stdout and
    stderr kept as text (a failing exit is the caller's to read); `env` is its whole
    environment (None: this process's). subprocess.TimeoutExpired after `timeout_s` (the
    child killed), OSError when it cannot start."""
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, env=env,
                          preexec_fn=die_with_parent(os.getpid()))


def spawn(*args: str, quiet: bool = True) -> subprocess.Popen[bytes]:
    """`python -m kvpool ARGS` as a child that dies with this process, in a session of its own
    (a terminal's Ctrl-C reaches only this process, which stops the children in order). A
    store node whose master died at the same moment still stops within its close_timeout_s."""
    return spawn_command(Command(tuple(kvpool_argv(*args))), quiet)


def check_alive(procs: Sequence[subprocess.Popen[Any]],
                what: str | Callable[[], object] = "") -> None:
    """KvpoolError naming the first of `procs` that has exited (its pid, code, command line)."""
    for p in procs:
        if p.poll() is not None:
            args = (" ".join(map(str, p.args)) if isinstance(p.args, list | tuple)
                    else str(p.args))
            waiting = f" (waiting for {said(what)})" if what else ""
            raise KvpoolError(f"process {p.pid} exited with code {p.returncode} "
                              f"({args}){waiting}")


def said(what: str | Callable[[], object]) -> str:
    """A wait's description: `what`, or what it says now when it is a callable."""
    return str(what() if callable(what) else what)
