"""`kvpool bench mooncake-cpu`: where a single-key operation's time goes. For each
implementation (kvpool, the real Mooncake wheel) a master and a memory-node process, and a
pure client in this process, run the same loop of Mooncake API calls over tcp; printed per
operation: wall time, and user/system CPU of the client, the master and the node (from
/proc/PID/stat), so it shows which process, and whether Python or the kernel, is on the
critical path. Linux only.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from typing import Any

import numpy as np

from kvpool.bench.anchors import raw_socket
from kvpool.bench.mooncake_api import master_process, node_process
from kvpool.bench.mooncake_client import load

_TICKS = os.sysconf("SC_CLK_TCK")
VALUE_BYTES = 4096
WARM_KEYS = 200


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("mooncake-cpu", help="per single-key op: wall time and CPU of "
                              "client, master and node, kvpool vs the real Mooncake")
    p.add_argument("--ops", type=int, default=3000, help="calls per operation")
    p.add_argument("--impl", choices=("both", "kvpool", "mooncake"), default="both")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    impls = ["kvpool", "mooncake"] if args.impl == "both" else [args.impl]
    print(f"{'impl':9}{'op':10}{'wall us':>9}  {'client':>9}{'master':>9}{'node':>9}"
          "   (CPU us per op, user/system)")
    for impl in impls:
        for line in measure(impl, args.ops):
            print(line, flush=True)
    with raw_socket() as raw:
        _, rate = raw.round_trips(64, args.ops)
    print(f"{'raw-tcp':9}{'64 B rtt':10}{1e6 / rate:9.1f}  (a blocking Python socket "
          "round trip between two processes, the anchor)")
    return 0


def measure(impl: str, ops: int) -> Iterator[str]:
    with ExitStack() as stack:
        master, master_pid = stack.enter_context(master_process(impl))
        node_pid = stack.enter_context(node_process(impl, master, 512 << 20))
        store = load(impl)[0].MooncakeDistributedStore()
        if store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", master) != 0:
            raise RuntimeError(f"{impl} store setup failed")
        buf = np.zeros(1 << 20, dtype=np.uint8)  # registered: alive until the store closes
        try:
            for op, call in _operations(store, buf).items():
                yield _one(impl, op, call, ops, master_pid, node_pid)
        finally:
            store.close()


def _operations(store: Any, buf: np.ndarray) -> dict[str, Callable[[int], Any]]:
    ptr = int(buf.ctypes.data)
    store.register_buffer(ptr, buf.nbytes)
    value = bytes(VALUE_BYTES)
    for i in range(WARM_KEYS):
        store.put(f"warm-{i}", value)
    stamp = time.perf_counter_ns

    return {  # puts take fresh keys: Mooncake answers a put of an existing key at once
        "is_exist": lambda i: store.is_exist(f"warm-{i % WARM_KEYS}"),
        "get": lambda i: store.get(f"warm-{i % WARM_KEYS}"),
        "put": lambda i: store.put(f"p-{i}-{stamp()}", value),
        "get_into": lambda i: store.get_into(f"warm-{i % WARM_KEYS}", ptr, VALUE_BYTES),
        "put_from": lambda i: store.put_from(f"q-{i}-{stamp()}", ptr, VALUE_BYTES),
    }


def _one(impl: str, op: str, call: Callable[[int], Any], ops: int, master_pid: int,
         node_pid: int) -> str:
    for i in range(min(200, ops)):
        call(i)
    pids = (os.getpid(), master_pid, node_pid)
    before, t0 = [cpu_times(p) for p in pids], time.perf_counter()
    for i in range(ops):
        call(i)
    wall = time.perf_counter() - t0
    used = [tuple((b - a) / ops * 1e6 for a, b in zip(x, y, strict=True))
            for x, y in zip(before, [cpu_times(p) for p in pids], strict=True)]
    cols = "".join(f"{f'{u:.0f}/{s:.0f}':>9}" for u, s in used)
    return f"{impl:9}{op:10}{wall / ops * 1e6:9.1f}  {cols}"


def cpu_times(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of a process so far."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) / _TICKS, int(fields[12]) / _TICKS
