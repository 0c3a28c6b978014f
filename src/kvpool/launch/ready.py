"""Readiness announced by the child: a line on a pipe instead of polling its port.

The launcher makes a pipe, starts `python -m kvpool --ready-fd N COMMAND ...` with the pipe's
write end as descriptor N, and reads one line from the read end (`ReadyPipe.wait`). The child
(`kvpool master`, `kvpool store-node`, `kvpool worker`) writes that line once it serves
(`announce_ready`: the master once it listens, a store node once its memory is mounted, a
worker once its HTTP server listens) and closes its end. A child that exits first closes it
too: the launcher reads end-of-file and says so at once, with the child's exit code.

Only the process named by --ready-fd writes there: the flag is an argument, not inherited by
what the child starts, and a descriptor that is not a pipe at start-up is ignored.
"""

from __future__ import annotations

import os
import select
import stat
import subprocess
import time
from collections.abc import Sequence
from typing import Any

from kvpool.errors import KvpoolError
from kvpool.launch.children import check_alive

READY_FLAG = "--ready-fd"
_KVPOOL = ("-m", "kvpool")

_ready_fd: int | None = None
"""This process's end of its launcher's pipe (set from --ready-fd), until announced."""


def set_ready_fd(fd: int | None) -> None:
    """Take descriptor `fd` (the --ready-fd of this process) as the pipe to announce on; one
    that is not an open pipe is ignored (a launcher that passed none)."""
    global _ready_fd
    _ready_fd = None
    if fd is None:
        return
    try:
        if stat.S_ISFIFO(os.fstat(fd).st_mode):
            _ready_fd = fd
    except OSError:
        pass


def announce_ready(line: str, echo: bool = True) -> None:
    """Say `line` (on stdout when `echo`) and, when started with --ready-fd, on that pipe,
    which is then closed (announced once)."""
    global _ready_fd
    if echo:
        print(line, flush=True)
    fd, _ready_fd = _ready_fd, None
    if fd is None:
        return
    try:
        os.write(fd, (line.replace("\n", " ") + "\n").encode())
    except OSError:  # the launcher is gone or stopped listening
        pass
    finally:
        os.close(fd)


class ReadyPipe:
    """The launcher's side: a pipe whose write end one child gets (`argv` puts it on its
    command line, `write_fd` is what to pass it), and the wait for its line."""

    def __init__(self) -> None:
        self.read_fd, self.write_fd = os.pipe()
        self._line = b""

    def argv(self, argv: Sequence[str]) -> tuple[str, ...]:
        """`python -m kvpool ARGS` with --ready-fd naming the write end, for the child."""
        if tuple(argv[1:3]) != _KVPOOL:
            raise ValueError(f"not a kvpool command line: {' '.join(argv)}")
        return (*argv[:3], READY_FLAG, str(self.write_fd), *argv[3:])

    def spawned(self) -> None:
        """The child has its copy of the write end: drop ours (so its exit reads as EOF)."""
        if self.write_fd >= 0:
            os.close(self.write_fd)
            self.write_fd = -1

    def close(self) -> None:
        self.spawned()
        if self.read_fd >= 0:
            os.close(self.read_fd)
            self.read_fd = -1

    def wait(self, child: subprocess.Popen[Any], what: str, timeout_s: float,
             others: Sequence[subprocess.Popen[Any]] = ()) -> str:
        """The child's line once it announces it; KvpoolError when it exits first (or one of
        `others`, which it depends on), TimeoutError after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._line:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"not within {timeout_s} s: {what} to say it is ready")
            readable, _, _ = select.select([self.read_fd], [], [], min(left, 0.25))
            if readable:
                chunk = os.read(self.read_fd, 4096)
                if not chunk:
                    self._closed_early(child, what)
                self._line += chunk
            check_alive(others, f"{what} to say it is ready")
        self.close()
        return self._line.split(b"\n", 1)[0].decode(errors="replace")

    def _closed_early(self, child: subprocess.Popen[Any], what: str) -> None:
        """The pipe closed without a line: KvpoolError, with the exit code once it exits."""
        try:
            child.wait(5.0)
        except subprocess.TimeoutExpired:
            raise KvpoolError(f"{what} closed its readiness pipe without a line") from None
        check_alive([child], f"{what} to say it is ready")
