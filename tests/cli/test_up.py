"""`kvpool up --store-only --demo` as a user runs it: a real master, real store nodes, a SIGKILL,
verified bytes. The serving cluster (`kvpool up` with workers and the proxy) is tested in
tests/serve/test_up_serving.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.serve.conftest import child_pid, marked_pids, wait_gone
from tests.support.procs import python_env
from tests.support.wait import wait_for


def test_up_demo_runs_a_whole_local_cluster() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvpool", "up", "--store-only", "--demo", "--no-bench",
         "--dram", "64MiB"],
        capture_output=True, text=True, timeout=120, env=python_env(),
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "content verified: True" in out.stdout
    assert "replicated objects still readable: 64/64, wrong bytes returned: 0" in out.stdout
    assert "demo: all checks passed" in out.stdout


def test_up_rejects_bad_node_count() -> None:
    out = subprocess.run([sys.executable, "-m", "kvpool", "up", "--store-only", "--store-nodes", "0"],
                         capture_output=True, text=True, timeout=60, env=python_env())
    assert out.returncode == 2
    assert "--store-nodes must be >= 1" in out.stderr


def test_up_refuses_a_bad_restart_budget() -> None:
    out = subprocess.run([sys.executable, "-m", "kvpool", "up", "--max-restarts", "-1"],
                         capture_output=True, text=True, timeout=60, env=python_env())
    assert out.returncode == 2
    assert out.stderr == "kvpool up: max_restarts must be >= 0, not -1\n"


def test_up_refuses_no_proxy_process() -> None:
    out = subprocess.run([sys.executable, "-m", "kvpool", "up", "--proxy-workers", "0"],
                         capture_output=True, text=True, timeout=60, env=python_env())
    assert out.returncode == 2
    assert out.stderr == "kvpool up: --proxy-workers must be >= 1\n"


@pytest.mark.parametrize("port", ["0", "70000"])
def test_up_refuses_a_port_it_could_not_be_reached_on(port: str) -> None:
    out = subprocess.run([sys.executable, "-m", "kvpool", "up", "--port", port],
                         capture_output=True, text=True, timeout=60, env=python_env())
    assert out.returncode == 2
    assert out.stderr == f"kvpool up: --port must be in 1..65535, got {port}\n"


def test_up_needs_a_prefill_and_a_decode_worker() -> None:
    out = subprocess.run([sys.executable, "-m", "kvpool", "up", "--decode", "0"],
                         capture_output=True, text=True, timeout=60, env=python_env())
    assert out.returncode == 2
    assert "need at least one prefill and one decode worker" in out.stderr


@contextmanager
def _store_only_up(tmp_path: Path, nodes: int, dram: str) -> Iterator[
        tuple[subprocess.Popen[bytes], Path, str]]:
    """`kvpool up --store-only --max-restarts 0` until its banner (the process, its log, the
    marker its children carry); whatever is left of it is killed at the end."""
    marker = f"up-{uuid.uuid4().hex}"
    log = tmp_path / "up.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvpool", "up", "--store-only", "--store-nodes", str(nodes),
             "--dram", dram, "--max-restarts", "0"], stdout=out, stderr=subprocess.STDOUT,
            env=python_env() | {"KVPOOL_TEST_MARKER": marker})
    try:
        wait_for(lambda: "Ctrl-C to stop" in log.read_text(), 90.0, log.read_text, 0.1,
                 procs=[proc])
        yield proc, log, marker
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        wait_gone(marker)  # (kills what is left)


def test_up_stops_with_status_1_when_it_gives_up_on_a_process(tmp_path: Path) -> None:
    """`--max-restarts 0`: the store node SIGKILLed, `kvpool up` says which process it gave up
    on and how it ended, stops the rest and exits 1 (a supervisor above it sees a failure)."""
    with _store_only_up(tmp_path, 1, "64MiB") as (proc, log, marker):
        node = child_pid(marker, "store-node")
        os.kill(node, signal.SIGKILL)
        assert proc.wait(30) == 1, log.read_text()
        assert ("kvpool up: giving up on store-node-0: it was killed by SIGKILL after 0 "
                "restarts within 300 s; stopping the cluster; no process was restarted"
                ) in log.read_text()
        assert wait_gone(marker) == []
    assert marked_pids(marker) == []


def test_up_passes_the_proxys_flags_on_as_given() -> None:
    """The proxy flags `kvpool up` takes reach the proxy's command line, and those not given
    are left to the proxy's own defaults."""
    from kvpool.cli.main import build_parser
    from kvpool.cli.up_cmd import _proxy_flags

    args = build_parser().parse_args(["up", "--loop-poll-us", "0", "--stream-interval", "4",
                                      "--worker-sse"])
    flags = _proxy_flags(args)
    assert ("--loop-poll-us", "0") == flags[flags.index("--loop-poll-us"):][:2]
    assert ("--stream-interval", "4") == flags[flags.index("--stream-interval"):][:2]
    assert "--worker-sse" in flags
    assert "--loop-poll-us" not in _proxy_flags(build_parser().parse_args(["up"]))



@pytest.mark.slow
def test_a_sigterm_during_the_give_up_stop_keeps_status_1(tmp_path: Path) -> None:
    """Given up on a process, `up` exits 1, a SIGTERM during its stop (a service manager's, a
    second Ctrl-C) notwithstanding; a stopped (SIGSTOP) node is continued and stopped."""
    with _store_only_up(tmp_path, 2, "16MiB") as (proc, log, marker):
        nodes = [p for p in marked_pids(marker)
                 if b"\0store-node\0" in Path(f"/proc/{p}/cmdline").read_bytes()]
        assert len(nodes) == 2
        os.kill(nodes[1], signal.SIGSTOP)  # slow to stop: the stop takes its 10 s
        os.kill(nodes[0], signal.SIGKILL)  # given up on: exit status 1 is due
        wait_for(lambda: "giving up on" in log.read_text(), 30, log.read_text, 0.1)
        time.sleep(1.0)  # the stop is under way
        proc.send_signal(signal.SIGTERM)  # e.g. a service manager's stop, or a second Ctrl-C
        assert proc.wait(30) == 1, log.read_text()
