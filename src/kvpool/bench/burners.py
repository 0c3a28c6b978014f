"""CPU burners: N processes that spin for the duration of a `with` block, so a benchmark can
measure on a machine loaded by other work (`kvpool bench mooncake-api --load N`). Each is a
plain Python loop at normal priority, as another tenant's job would be."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

from kvpool.launch.children import stop

_SPIN = "while True: pass"


@contextmanager
def burning(count: int) -> Iterator[list[int]]:
    """`count` spinning processes (none for 0) until the block ends: their pids."""
    with ExitStack() as stack:
        procs = []
        for _ in range(count):
            proc = subprocess.Popen([sys.executable, "-c", _SPIN])
            stack.callback(stop, proc, 2.0)
            procs.append(proc)
        yield [p.pid for p in procs]
