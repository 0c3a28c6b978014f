"""Whether a child outlives its parent: a real parent process starts a child with the
launcher under test, says the child's pid once the child is up, and is killed with SIGKILL."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from kvpool.launch.children import stop
from kvpool.launch.wait import wait_for
from tests.support.procs import python_env

_PARENT = """
import json, sys, time
{start}
print(json.dumps(said), flush=True)
time.sleep(60)
"""


def gone(pid: int) -> bool:
    """Whether `pid` has exited (a zombie no one reaps counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def kill_parent_of(start: str, timeout_s: float = 10.0) -> dict[str, object]:
    """Runs `start` (code that starts a child and sets `said`, a dict with the child's "pid")
    in a parent process, kills that parent once it has said it, and waits until the child is
    gone (TimeoutError if it outlives the parent by `timeout_s`); returns what was said."""
    code = _PARENT.format(start=textwrap.dedent(start))
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                              env=python_env())
    try:
        assert parent.stdout is not None
        line = parent.stdout.readline()
        assert line, f"the parent exited with code {parent.wait()} before it said a pid"
        said = json.loads(line)
        child_pid = int(said["pid"])
        assert not gone(child_pid), f"child {child_pid} exited before its parent was killed"
        parent.kill()
        parent.wait()
        wait_for(lambda: gone(child_pid), timeout_s, f"child {child_pid} to exit")
        return dict(said)
    finally:
        stop(parent)
