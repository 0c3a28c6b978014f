"""`kvpool up` in a real terminal (a pseudo-terminal, as a user's shell gives it): its start-up
stages print in order as they happen, and Ctrl-C typed at the terminal (the line discipline's
SIGINT to the foreground process group) is a clean stop, one line per stage, exit status 0,
no process left."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import signal
import subprocess
import sys
import termios
import time
import uuid
from pathlib import Path

from kvpool.launch.ports import free_port
from tests.serve.conftest import wait_gone
from tests.support.procs import python_env


def read_until(fd: int, pattern: str, seen: list[str], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not re.search(pattern, "".join(seen)):
        left = deadline - time.monotonic()
        assert left > 0, f"{pattern!r} not seen in:\n{''.join(seen)}"
        ready, _, _ = select.select([fd], [], [], min(left, 1.0))
        if ready:
            try:
                seen.append(os.read(fd, 65536).decode("utf-8", "replace"))
            except OSError:  # the terminal closed: everything it had was read
                return


def _as_a_shell_starts_it() -> None:
    """In the child, before exec: the pseudo-terminal as its controlling terminal, and SIGINT
    as an interactive shell leaves it. A test run started in the background by a
    non-interactive shell ignores SIGINT, and an ignored SIGINT is inherited (Python then
    installs no KeyboardInterrupt handler): Ctrl-C would do nothing."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


def test_a_terminal_sees_each_stage_and_ctrl_c_stops_it_cleanly(cache_home: Path) -> None:
    marker = f"up-{uuid.uuid4().hex}"
    env = python_env() | {"KVPOOL_TEST_MARKER": marker, "XDG_CACHE_HOME": str(cache_home),
                          "TERM": "dumb"}
    main, child = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvpool", "up", "--model", "tiny", "--engine", "emulated",
         "--speed-up", "100", "--port", str(free_port())],
        stdin=child, stdout=child, stderr=child, env=env, start_new_session=True,
        preexec_fn=_as_a_shell_starts_it)
    os.close(child)
    seen: list[str] = []
    try:
        read_until(main, r"Ctrl-C to stop", seen, 120)
        text = "".join(seen).replace("\r\n", "\n")
        stages = ["model .* checked", "master ready", r"store node\(s\) mounted",
                  "prefill worker ready", "decode worker ready", "proxy ready", "try: curl",
                  "Ctrl-C to stop"]
        assert re.search(".*".join(stages), text, re.S), text
        os.write(main, b"\x03")  # Ctrl-C, as typed
        read_until(main, r"kvpool up: stopped \(", seen, 60)
        assert proc.wait(30) == 0
        text = "".join(seen).replace("\r\n", "\n")
        tail = text[text.index("Ctrl-C to stop"):]
        assert re.search("stopping the proxy.*stopping 2 workers.*stopping the store node.*"
                         r"stopping the master.*kvpool up: stopped \(", tail, re.S), tail
        assert "Traceback" not in text, text
        assert wait_gone(marker) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(main)
        wait_gone(marker)
