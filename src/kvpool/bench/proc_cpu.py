"""CPU time of processes, read from /proc, for benchmarks that charge work to a process.

    /proc/PID/stat   "pid (comm) state ppid ... utime stime ..."   (fields 14 and 15, in clock
                     ticks, every thread of the process summed; comm may hold spaces and ')',
                     so fields are counted after the last ')')
    /proc/PID/task/TID/children   the pids of its children (nginx's workers under its master)
    /proc/PID/task/TID/stat       the same fields for one thread (its comm: the OS thread name)
    /proc/PID/io     "syscw: N": the write-family system calls it made (write, writev: a
                     relay's writes to its sockets; send and sendmsg are not counted)

    /proc/PID/task/TID/schedstat  "NS_ON_CPU NS_WAITING SLICES": one thread's time on a CPU in
                     nanoseconds (the kernel's own sum, not scaled into ticks)

`CpuMeter` sums the CPU seconds of a fixed set of processes between `start()` and
`seconds()`: each process's time on a CPU in nanoseconds (its threads' schedstat summed), or,
when that falls more than CLOSE_TICKS behind its utime + stime in ticks (a thread ended in
between and took its share with it), the ticks. A process that has exited counts what it had
used when last read. (Ticks alone are 10 ms at 100 Hz: 96 requests of 1.5 ms each were 15 of
them, so one tick more or less moved the figure by 7%.) `WriteMeter`
counts their write calls the same way; `ThreadShareMeter` splits processes' CPU into all of
their threads' and that of the threads of one name, from the same reads.
"""

from __future__ import annotations

import os
from pathlib import Path

from kvpool.thread_name import os_name

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


def task_ns(task: Path) -> int:
    """Nanoseconds on a CPU of one thread (`task`: /proc/PID/task/TID); FileNotFoundError if
    it ended, or the kernel has no schedstat."""
    return int((task / "schedstat").read_text().split()[0])


def cpu_ns(pid: int) -> int | None:
    """Nanoseconds on a CPU of the live threads of process `pid` (their schedstat summed);
    None where the kernel has no schedstat; OSError if the process is gone."""
    total, seen = 0, False
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += task_ns(task)
            seen = True
        except FileNotFoundError:  # the thread ended meanwhile, or no schedstat at all
            continue
    return total if seen else None


def stat_comm(stat: str) -> str:
    """The `comm` of a /proc/PID/stat (or task) line: the name between the parentheses."""
    return stat[stat.find("(") + 1:stat.rfind(")")]


def thread_cpu(pid: int) -> dict[int, tuple[float, str]]:
    """{thread id: (CPU seconds, its OS name)} of the live threads of process `pid`: its time
    on a CPU in nanoseconds (schedstat), or its utime + stime ticks where the kernel has no
    schedstat; OSError if the process is gone."""
    out: dict[int, tuple[float, str]] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
            try:
                used = task_ns(task) / 1e9
            except FileNotFoundError:
                used = stat_ticks(stat) / TICKS_PER_S
        except OSError:  # the thread ended meanwhile
            continue
        out[int(task.name)] = (used, stat_comm(stat))
    return out


def write_calls(pid: int) -> int:
    """The write-family system calls process `pid` has made so far (/proc/PID/io `syscw`);
    OSError if it is gone or the file cannot be read."""
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("syscw:"):
            return int(line.split()[1])
    raise OSError(f"/proc/{pid}/io has no syscw line")


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


CLOSE_TICKS = 3
"""How far (in ticks) a process's nanosecond figure may fall behind its tick figure before
the ticks are taken instead (each reading of ticks is up to one tick off)."""


class CpuMeter:
    """The CPU seconds `pids` use together between `start()` and `seconds()` (a thread's
    share of it: `ThreadShareMeter`)."""

    def __init__(self, pids: list[int]) -> None:
        if not pids:
            raise ValueError("CpuMeter needs at least one pid")
        self.pids = list(pids)
        self._first: dict[int, tuple[float, int | None]] = {}
        self._last: dict[int, tuple[float, int | None]] = {}

    def _read(self) -> dict[int, tuple[float, int | None]]:
        for p in self.pids:
            try:
                self._last[p] = (cpu_s(p), cpu_ns(p))
            except OSError:  # exited: keep what it had used when last read
                pass
        return dict(self._last)

    def start(self) -> None:
        self._first = self._read()

    def seconds(self) -> float:
        """CPU seconds used since `start()`."""
        total = 0.0
        for p, (ticks_s, ns) in self._read().items():
            first_s, first_ns = self._first.get(p, (0.0, 0))
            coarse = ticks_s - first_s
            fine = None if ns is None or first_ns is None else (ns - first_ns) / 1e9
            total += fine if fine is not None and fine > coarse - CLOSE_TICKS / TICKS_PER_S \
                else coarse
        return total


class ThreadShareMeter:
    """The CPU seconds the live threads of `pids` use between `start()` and `seconds()`, and
    the share of it their threads named `thread` use: (all, named), from one read of each
    thread, so the share never exceeds the whole. (Read apart, /proc/PID/stat and the
    threads' own figures are scaled separately by the kernel: a worker's engine thread once
    came out 50 ms above its whole process over half a second.) A thread that ends between
    the two reads is not counted; a thread that starts counts from zero."""

    def __init__(self, pids: list[int], thread: str) -> None:
        if not pids:
            raise ValueError("ThreadShareMeter needs at least one pid")
        self.pids, self.thread = list(pids), os_name(thread)
        self._start: dict[tuple[int, int], float] = {}

    def _read(self) -> dict[tuple[int, int], tuple[float, str]]:
        out: dict[tuple[int, int], tuple[float, str]] = {}
        for p in self.pids:
            try:
                out.update({(p, tid): v for tid, v in thread_cpu(p).items()})
            except OSError:  # the process is gone
                pass
        return out

    def start(self) -> None:
        self._start = {key: used for key, (used, _) in self._read().items()}

    def seconds(self) -> tuple[float, float]:
        """(all threads', the named threads') CPU seconds since `start()`."""
        whole = named = 0.0
        for key, (now, name) in self._read().items():
            used = now - self._start.get(key, 0.0)
            whole += used
            named += used if name == self.thread else 0.0
        return whole, named


class WriteMeter:
    """The write calls `pids` make together between `start()` and `calls()` (a process that
    has exited counts what it had made when last read)."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = list(pids)
        self._last = {p: 0 for p in self.pids}
        self._start = 0

    def _read(self) -> int:
        for p in self.pids:
            try:
                self._last[p] = write_calls(p)
            except OSError:  # exited
                pass
        return sum(self._last.values())

    def start(self) -> None:
        self._start = self._read()

    def calls(self) -> int:
        """Write calls made since `start()`."""
        return self._read() - self._start
