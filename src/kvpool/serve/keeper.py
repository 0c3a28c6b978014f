"""`python -m kvpool.serve.keeper GRACE_S CMD...`: runs CMD (the store master) for `kvpool up`
and outlives `kvpool up` by GRACE_S seconds.

When `kvpool up` is killed outright, every child gets its parent-death SIGTERM at the same
moment; a store node then unmounts from a master that is already gone and waits out its RPC
timeouts. The keeper gives the master's clients that grace before stopping it. When
`kvpool up` itself stops the keeper (it is still alive), the master is stopped at once: by then
its clients are gone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

from kvpool.serve.launch import die_with_parent, stop


def main(argv: list[str]) -> int:
    grace_s, cmd = float(argv[0]), argv[1:]
    parent = os.getppid()
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    signal.signal(signal.SIGINT, lambda *_: stopping.set())
    child = subprocess.Popen(cmd, preexec_fn=die_with_parent(os.getpid()))
    while child.poll() is None and not stopping.wait(0.2):
        pass
    if child.poll() is None:
        if os.getppid() != parent:
            time.sleep(grace_s)
        stop(child)
    return child.returncode or 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
