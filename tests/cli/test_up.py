"""`kvpool up --store-only --demo` as a user runs it: a real master, real store nodes, a SIGKILL,
verified bytes. The serving cluster (`kvpool up` with workers and the proxy) is tested in
tests/serve/test_up_serving.py."""

from __future__ import annotations

import subprocess
import sys

from tests.support.procs import python_env


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


def test_up_needs_a_prefill_and_a_decode_worker() -> None:
    out = subprocess.run([sys.executable, "-m", "kvpool", "up", "--decode", "0"],
                         capture_output=True, text=True, timeout=60, env=python_env())
    assert out.returncode == 2
    assert "need at least one prefill and one decode worker" in out.stderr
