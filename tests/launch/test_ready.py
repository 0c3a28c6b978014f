"""Readiness announced by the child (kvpool.launch.ready), over real `kvpool master`
processes: the line comes once it serves, a child that exits first is reported at once with
its exit code, a restarted child announces on a fresh pipe, and a descriptor that is no pipe
is never written to."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from kvpool.errors import KvpoolError
from kvpool.launch.children import Command, stop
from kvpool.launch.ports import free_port
from kvpool.launch.ready import ReadyPipe, announce_ready, set_ready_fd
from kvpool.launch.table import ChildTable


@dataclass
class Table(ChildTable):
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    commands: dict[str, Command] = field(default_factory=dict)
    ready: dict[str, ReadyPipe] = field(default_factory=dict)


def _master(table: Table, rpc: int, admin: int) -> None:
    table.start("master", "master", "--rpc-port", str(rpc), "--admin-port", str(admin),
                "--no-http-metadata", announce=True)


def test_a_master_announces_once_it_serves() -> None:
    table, rpc, admin = Table(), free_port(), free_port()
    try:
        _master(table, rpc, admin)
        line = table.wait_ready("master", "the master", 30.0)
        assert line.startswith(f"kvpool master ready: rpc 127.0.0.1:{rpc} admin {admin}")
        assert httpx.get(f"http://127.0.0.1:{admin}/health", timeout=2).status_code == 200
    finally:
        table.stop_all()


@pytest.mark.slow
def test_a_restarted_child_announces_on_a_fresh_pipe() -> None:
    table, rpc, admin = Table(), free_port(), free_port()
    try:
        _master(table, rpc, admin)
        table.wait_ready("master", "the master", 30.0)
        first = table.procs["master"]
        stop(first)
        table.restart("master")
        assert table.procs["master"] is not first
        again = table.wait_ready("master", "the master", 30.0)
        assert again.startswith(f"kvpool master ready: rpc 127.0.0.1:{rpc}")
    finally:
        table.stop_all()


def test_a_child_that_exits_before_it_is_ready_is_reported_at_once() -> None:
    table = Table()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        try:
            _master(table, taken.getsockname()[1], free_port())
            started = time.monotonic()
            with pytest.raises(KvpoolError, match=r"exited with code [1-9]\d* .*"
                                                  r"waiting for the master to say it is ready"):
                table.wait_ready("master", "the master", 60.0)
            assert time.monotonic() - started < 20.0   # not the 60 s timeout
        finally:
            table.stop_all()


def test_the_ready_flag_is_only_for_kvpool_command_lines() -> None:
    pipe = ReadyPipe()
    try:
        assert pipe.argv(["/py", "-m", "kvpool", "--log-level", "WARNING", "master"]) == (
            "/py", "-m", "kvpool", "--ready-fd", str(pipe.write_fd), "--log-level", "WARNING",
            "master")
        with pytest.raises(ValueError, match="not a kvpool command line"):
            pipe.argv(["etcd", "--name", "x"])
    finally:
        pipe.close()


def test_a_descriptor_that_is_no_pipe_is_never_written(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "not-a-pipe"
    fd = os.open(path, os.O_CREAT | os.O_WRONLY)
    try:
        set_ready_fd(fd)
        announce_ready("kvpool x ready")
        assert path.read_bytes() == b""
        assert capsys.readouterr().out == "kvpool x ready\n"
    finally:
        os.close(fd)
    read_fd, write_fd = os.pipe()
    set_ready_fd(write_fd)
    announce_ready("kvpool y ready", echo=False)
    assert os.read(read_fd, 100) == b"kvpool y ready\n"
    assert os.read(read_fd, 100) == b""               # announced once, and closed
    os.close(read_fd)
