"""kvpool.supervisor over real child processes (a shell that exits at once, a sleep killed with
SIGKILL): each exit is restarted after its backoff with one line said, a child past its budget
stops supervision with a Failure naming it, and the children that behave are left alone."""

from __future__ import annotations

import signal
import subprocess
import time
from typing import Any

from kvpool.restart_policy import GiveUp, RestartConfig
from kvpool.supervisor import Failure, Supervisor, describe_exit

FAST = RestartConfig(first_delay_s=0.05, factor=2, max_delay_s=1, max_restarts=2, window_s=60)


class ShellChildren:
    """Named shell commands, started again by name (kvpool.supervisor.Children)."""

    def __init__(self, commands: dict[str, str]) -> None:
        self.commands = commands
        self.procs: dict[str, subprocess.Popen[Any]] = {}
        self.starts: list[str] = []
        for name in commands:
            self.restart(name)
        self.starts.clear()

    def restart(self, name: str) -> subprocess.Popen[Any]:
        self.procs[name] = subprocess.Popen(["/bin/sh", "-c", self.commands[name]])
        self.starts.append(name)
        return self.procs[name]

    def stop_all(self) -> None:
        for proc in self.procs.values():
            proc.kill()
            proc.wait()


def test_a_child_that_keeps_exiting_is_restarted_then_given_up_on() -> None:
    children = ShellChildren({"steady": "exec sleep 30", "flaky": "exit 3"})
    steady = children.procs["steady"]
    lines: list[str] = []
    try:
        failure = Supervisor(children, FAST, say=lines.append).run(interval_s=0.01)
    finally:
        children.stop_all()
    assert failure == Failure("flaky", "exited with status 3", GiveUp(2, 60))
    assert str(failure) == ("giving up on flaky: it exited with status 3 after 2 restarts "
                            "within 60 s")
    assert children.starts == ["flaky", "flaky"]
    assert children.procs["steady"] is steady  # left alone (killed by stop_all only)
    assert [line.split(" (pid ")[0] for line in lines] == ["flaky", "flaky started again",
                                                             "flaky", "flaky started again"]
    assert lines[0].endswith("exited with status 3; restart 1 of at most 2 within 60 s, in "
                             "0.05 s (restarts so far: 1)"), lines
    assert lines[2].endswith("restart 2 of at most 2 within 60 s, in 0.1 s (restarts so "
                             "far: 2)"), lines


def test_a_killed_child_comes_back_after_its_delay_and_is_counted() -> None:
    children = ShellChildren({"master": "exec sleep 30", "worker": "exec sleep 30"})
    first = children.procs["worker"]
    lines: list[str] = []
    published: list[dict[str, int]] = []
    supervisor = Supervisor(children, FAST, say=lines.append, counted=published.append)
    try:
        assert supervisor.check() is None and lines == [] and published == []
        first.send_signal(signal.SIGKILL)
        first.wait()
        killed_at = time.monotonic()
        assert supervisor.check() is None
        assert lines == [f"worker (pid {first.pid}) was killed by SIGKILL; restart 1 of at "
                         f"most 2 within 60 s, in 0.05 s (restarts so far: 1)"]
        assert children.procs["worker"] is first  # not before its delay
        assert published == [{"master": 0, "worker": 1}]
        while children.procs["worker"] is first:
            assert time.monotonic() - killed_at < 5
            assert supervisor.check() is None
            time.sleep(0.01)
        assert time.monotonic() - killed_at >= 0.05
        assert children.procs["worker"].poll() is None
        assert lines[1] == f"worker started again (pid {children.procs['worker'].pid})"
        assert supervisor.num_restarts == {"worker": 1}
        assert supervisor.summary() == "1 restart (worker 1)"
    finally:
        children.stop_all()


def test_no_restart_no_summary_and_exit_words() -> None:
    assert Supervisor(ShellChildren({}), FAST).summary() == "no process was restarted"
    assert describe_exit(0) == "exited with status 0"
    assert describe_exit(-15) == "was killed by SIGTERM"
    assert describe_exit(-200) == "was killed by signal 200"
