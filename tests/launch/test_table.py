"""How `kvpool up` stops its children (kvpool.launch.table.ChildTable.stop_all), over real
processes: one line per group, last started first, a group signalled at once, a group already
gone left unsaid, and the end with its time."""

from __future__ import annotations

import re
import subprocess
import time
from dataclasses import dataclass, field

from kvpool.launch.children import Command
from kvpool.launch.ready import ReadyPipe
from kvpool.launch.table import ChildTable

SLOW_TERM = "trap 'sleep 0.5; exit 0' TERM; while :; do sleep 0.05; done"
"""A child that takes 0.5 s to exit on SIGTERM, as a worker closing its pool client does."""


@dataclass
class Table(ChildTable):
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    commands: dict[str, Command] = field(default_factory=dict)
    ready: dict[str, ReadyPipe] = field(default_factory=dict)

    def shell(self, name: str, script: str) -> None:
        self.procs[name] = subprocess.Popen(["/bin/sh", "-c", script])


def test_children_stop_a_group_at_a_time_with_one_line_each() -> None:
    table = Table()
    for name in ("master", "store-node-0", "prefill-0", "decode-1", "both-2", "proxy"):
        table.shell(name, SLOW_TERM if name[0] in "pdb" else "exec sleep 30")
    table.shell("etcd", "exit 0")
    table.procs["etcd"].wait()  # gone before the stop: no line for it
    lines: list[tuple[float, str]] = []
    table.stop_all(lambda line: lines.append((time.monotonic(), line)))
    said = [line for _, line in lines]
    assert said[:4] == ["stopping the proxy", "stopping 3 workers", "stopping the store node",
                        "stopping the master"]
    assert len(said) == 5 and re.fullmatch(r"stopped \(\d+\.\d s\)", said[4]), said
    assert all(p.poll() is not None for p in table.procs.values())
    workers_s = lines[2][0] - lines[1][0]
    assert 0.5 <= workers_s < 1.2  # the three workers at once, not one after the other (1.5 s)


def test_silent_without_say() -> None:
    table = Table()
    table.shell("proxy", "exec sleep 30")
    table.stop_all()
    assert table.procs["proxy"].returncode is not None
