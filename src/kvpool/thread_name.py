"""The OS name of the calling thread (Linux's `comm`, at most 15 bytes), so /proc, top and
perf tell a process's threads apart: the worker's engine thread is `kvpool-engine`, and
`kvpool bench proxy` charges its CPU apart from the event loop's (bench/proc_cpu.py).
Elsewhere than Linux it does nothing."""

from __future__ import annotations

import ctypes
import sys

_PR_SET_NAME = 15
_OS_NAME_BYTES = 15


def os_name(name: str) -> str:
    """`name` as the OS keeps a thread's name: its first 15 bytes (a character cut there
    dropped). What /proc/PID/task/TID/comm shows for a thread named `name` here."""
    return name.encode()[:_OS_NAME_BYTES].decode(errors="ignore")


def name_os_thread(name: str) -> None:
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NAME, os_name(name).encode(), 0, 0, 0)
    except (OSError, AttributeError):  # no prctl: the thread keeps the process's name
        pass
