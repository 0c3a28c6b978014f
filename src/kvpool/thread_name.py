"""The OS name of the calling thread (Linux's `comm`, at most 15 bytes), so /proc, top and
perf tell a process's threads apart: the worker's engine thread is `kvpool-engine`, and
`kvpool bench proxy` charges its CPU apart from the event loop's (bench/proc_cpu.py).
Elsewhere than Linux it does nothing."""

from __future__ import annotations

import ctypes
import sys

_PR_SET_NAME = 15


def name_os_thread(name: str) -> None:
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):  # no prctl: the thread keeps the process's name
        pass
