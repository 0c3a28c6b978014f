"""How `kvpool up` stops its children (kvpool.launch.table.ChildTable.stop_all), over real
processes: one line per group, last started first, a group signalled at once, a group already
gone left unsaid, and the end with its time."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from kvpool.launch import children as children_module
from kvpool.launch.children import Command
from kvpool.launch.ready import ReadyPipe
from kvpool.launch.table import ChildTable
from tests.serve.conftest import pid_alive

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


def test_the_ten_seconds_are_the_groups_and_a_stopped_child_is_continued(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Children that ignore SIGTERM are killed when the group's time is up, not one after
    another; a stopped one (SIGSTOP) is continued, so it acts on SIGTERM at once."""
    monkeypatch.setattr(children_module, "STOP_S", 2.0)
    table = Table()
    for i in range(3):
        table.shell(f"decode-{i}", "trap '' TERM; while :; do sleep 0.05; done")
    table.shell("master", SLOW_TERM)
    time.sleep(0.2)
    table.procs["master"].send_signal(signal.SIGSTOP)
    t0 = time.monotonic()
    table.stop_all()
    took = time.monotonic() - t0
    assert took < 4.5, took  # 0.5 s for the master, then 2 s for the three workers at once
    # (one after another they took 0.5 + 3 x 2 s)
    assert all(p.poll() is not None for p in table.procs.values())
    assert table.procs["master"].returncode == 0  # it ran its SIGTERM trap


def test_a_restart_kills_what_the_last_incarnation_left_in_its_session(tmp_path: Path) -> None:
    """A server that started an engine process in its session (vLLM's API server) and died:
    the engine goes before the server starts again."""
    pidfile = tmp_path / "engine.pid"
    table = Table()
    table.run("decode-1", Command(("/bin/sh", "-c", f"sleep 300 & echo $! > {pidfile}; wait")))
    deadline = time.monotonic() + 10
    while not (pidfile.exists() and pidfile.read_text().strip()):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    engine = int(pidfile.read_text())
    table.procs["decode-1"].kill()
    table.procs["decode-1"].wait()
    table.restart("decode-1")
    try:
        deadline = time.monotonic() + 5
        while pid_alive(engine):
            assert time.monotonic() < deadline, "the engine of the first incarnation lives on"
            time.sleep(0.02)
    finally:
        table.stop_all()


def test_a_signal_during_the_stop_does_not_cut_it_short() -> None:
    """A second Ctrl-C (or SIGTERM) while children stop is ignored: every group is stopped."""
    table = Table()
    table.shell("master", SLOW_TERM)
    table.shell("proxy", SLOW_TERM)

    def say(line: str) -> None:  # told as the stop goes: the user presses Ctrl-C again
        if line == "stopping the proxy":
            os.kill(os.getpid(), signal.SIGINT)

    table.stop_all(say)  # a KeyboardInterrupt here would leave the master running
    assert all(p.poll() is not None for p in table.procs.values())

