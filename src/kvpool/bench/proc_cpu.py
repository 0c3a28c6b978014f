"""CPU time of processes, read from /proc, for benchmarks that charge work to a process.

    /proc/PID/stat   "pid (comm) state ppid ... utime stime ..."   (fields 14 and 15, in clock
                     ticks, every thread of the process summed; comm may hold spaces and ')',
                     so fields are counted after the last ')')
    /proc/PID/task/TID/children   the pids of its children (nginx's workers under its master)

`CpuMeter` sums the user + system seconds of a fixed set of processes between `start()` and
`seconds()`. A process that has exited counts what it had used when last read. The resolution
is one clock tick (10 ms at 100 Hz): measure stretches of at least a second.
"""

from __future__ import annotations

import os
from pathlib import Path

TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def stat_ticks(stat: str) -> int:
    """utime + stime (clock ticks) from the text of a /proc/PID/stat file. ValueError if it
    does not have their fields."""
    head, sep, rest = stat.rpartition(")")
    fields = rest.split()
    if not sep or "(" not in head or len(fields) < 13:
        raise ValueError(f"not a /proc/PID/stat line: {stat[:120]!r}")
    return int(fields[11]) + int(fields[12])


def cpu_s(pid: int) -> float:
    """User + system CPU seconds process `pid` has used so far; OSError if it is gone."""
    return stat_ticks(Path(f"/proc/{pid}/stat").read_text()) / TICKS_PER_S


def child_pids(pid: int) -> list[int]:
    """The pids of the live children of `pid` (every thread's list); [] if it is gone."""
    out: list[int] = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return out
    for task in tasks:
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return sorted(set(out))


def per_unit(cpu_seconds: float, units: int, scale: float) -> float:
    """CPU per unit (a token, a request) in `scale` units of a second (1e6: microseconds);
    0 when nothing was counted."""
    return cpu_seconds / units * scale if units > 0 else 0.0


class CpuMeter:
    """The CPU seconds `pids` use together between `start()` and `seconds()`."""

    def __init__(self, pids: list[int]) -> None:
        if not pids:
            raise ValueError("CpuMeter needs at least one pid")
        self.pids = list(pids)
        self._last = {p: 0.0 for p in self.pids}
        self._start = 0.0

    def _read(self) -> float:
        for p in self.pids:
            try:
                self._last[p] = cpu_s(p)
            except OSError:  # exited: keep what it had used when last read
                pass
        return sum(self._last.values())

    def start(self) -> None:
        self._start = self._read()

    def seconds(self) -> float:
        """CPU seconds used since `start()`."""
        return self._read() - self._start
