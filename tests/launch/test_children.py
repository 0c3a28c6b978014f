"""Children (kvpool.launch.children) and the one polling wait (kvpool.launch.wait), over real
processes: a child dies with its parent, a group is stopped whole, a wait fails as soon as a
child it depends on exits."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from kvpool.errors import KvpoolError
from kvpool.launch.children import Command, running, spawn_command, stop_group
from kvpool.launch.wait import wait_for, wait_port
from tests.launch.orphans import gone, kill_parent_of


def test_a_child_dies_with_its_parent_even_on_sigkill() -> None:
    kill_parent_of("""
        from kvpool.launch.children import Command, spawn_command
        child = spawn_command(Command((sys.executable, "-c", "import time; time.sleep(60)")))
        said = {"pid": child.pid}
    """)


def test_a_child_for_a_with_block_dies_with_its_parent() -> None:
    kill_parent_of("""
        from kvpool.launch.children import running
        block = running([sys.executable, "-c", "import time; time.sleep(60)"])
        child = block.__enter__()
        said = {"pid": child.pid}
    """)


def test_stop_group_ends_what_the_child_started_in_its_session() -> None:
    leader = spawn_command(Command(("/bin/sh", "-c", "sleep 60 & wait")))
    members = wait_for(lambda: _members(leader.pid) if len(_members(leader.pid)) == 2 else [],
                       5.0, "sh and its sleep in the session")
    stop_group(leader, timeout_s=5.0)
    assert leader.returncode is not None
    wait_for(lambda: all(gone(p) for p in members), 5.0, "the session to be gone")


def _members(session: int) -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and _session(int(p)) == session]


def _session(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[3])
    except (FileNotFoundError, ProcessLookupError):
        return -1


def test_a_wait_fails_at_once_when_a_child_it_depends_on_exits() -> None:
    with running([sys.executable, "-c", "import sys; sys.exit(3)"]) as proc:
        started = time.monotonic()
        with pytest.raises(KvpoolError, match=r"exited with code 3 .*\(waiting for port 1\)"):
            wait_for(lambda: False, 30.0, "port 1", procs=[proc])
        assert time.monotonic() - started < 5.0


def test_a_wait_times_out_naming_what_it_waited_for() -> None:
    with pytest.raises(TimeoutError, match=r"not within 0.2 s: the answer \(it is 41\)"):
        wait_for(lambda: False, 0.2, lambda: "the answer (it is 41)")
    assert wait_for(lambda: 42, 1.0) == 42


def test_wait_port_returns_once_something_listens() -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        wait_port(sock.getsockname()[1], timeout_s=2.0)


def test_a_short_command_run_for_its_output() -> None:
    from kvpool.launch.children import run_for_output

    done = run_for_output([sys.executable, "-c", "import os, sys; print(os.environ['X']); "
                           "sys.stderr.write('e'); sys.exit(3)"], 10.0, {**os.environ, "X": "x"})
    assert (done.returncode, done.stdout, done.stderr) == (3, "x\n", "e")
    with pytest.raises(subprocess.TimeoutExpired):
        run_for_output([sys.executable, "-c", "import time; time.sleep(30)"], 0.5)
