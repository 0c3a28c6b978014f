"""`kvpool proxy --workers N`: N proxy processes accepting on one listening socket.

This process binds HOST:PORT once and starts N copies of its own command line, each with
`--workers 1`, the socket's descriptor (`--listen-fd`), its index (`--peer-index`) and the
folder of the processes' booking sockets (`--peer-dir`, mode 0700, removed at exit), so that
the kernel spreads connections over them and each one's conductor sees the others' bookings
(serve/shared_bookings.py). It then waits: SIGTERM or SIGINT stops every process; one that
exits on its own stops the others, and this process exits 1 (a supervisor such as `kvpool up`
starts the proxy again).
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from types import FrameType

from kvpool.launch.children import Command, spawn_command, stop, stop_together
from kvpool.log import get_logger

log = get_logger("launch.proxy_group")
POLL_S = 0.2


def child_argv(argv: Sequence[str], index: int, count: int, fd: int, folder: str) -> list[str]:
    """Process `index`'s command line: this one's (`argv`: kvpool's own arguments, global
    options and `proxy ...`; a launcher's --ready-fd left out: the group's processes announce
    nothing) with the group's flags after it (argparse keeps the last)."""
    own = [a for i, a in enumerate(argv) if not a.startswith("--ready-fd")
           and not (i and argv[i - 1] == "--ready-fd")]
    return [sys.executable, "-m", "kvpool", *own, "--workers", "1", "--listen-fd", str(fd),
            "--peer-dir", folder, "--peer-index", str(index), "--num-peers", str(count)]


def run_group(argv: Sequence[str], host: str, port: int, count: int, backlog: int) -> int:
    """Serve with `count` processes until stopped; 0 when stopped by a signal, 1 when one of
    them exited on its own."""
    listener = socket.create_server((host, port), backlog=backlog)
    listener.set_inheritable(True)
    folder = tempfile.mkdtemp(prefix="kvpool-proxy-")
    procs: list[subprocess.Popen[bytes]] = []
    stopping: list[int] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stopping.append(signum)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        for i in range(count):
            procs.append(spawn_command(Command(tuple(child_argv(
                argv, i, count, listener.fileno(), folder))), quiet=False,
                pass_fds=[listener.fileno()]))
        log.info("kvpool proxy: %d processes on %s:%d", count, host, port)
        while not stopping:
            gone = [p for p in procs if p.poll() is not None]
            if gone:
                log.error("proxy process %d exited with code %s: stopping the others",
                          gone[0].pid, gone[0].returncode)
                return 1
            time.sleep(POLL_S)
        return 0
    finally:
        stop_together(procs, stop)
        listener.close()
        shutil.rmtree(folder, ignore_errors=True)
        for s, handler in old.items():
            signal.signal(s, handler)
