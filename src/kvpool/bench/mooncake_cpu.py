"""`kvpool bench mooncake-cpu`: where an operation's time goes. For each implementation
(kvpool, the real Mooncake wheel) a master and a memory-node process, and a pure client in
this process, run the same loop of Mooncake API calls over tcp; printed per call: wall time,
and user/system CPU of the client, the master and the node (from /proc/PID/stat), so it shows
which process, and whether Python or the kernel, is on the critical path. Single keys of
`--size` bytes, or with `--batch N` batched calls of N such keys each. Linux only.
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
from kvpool.units import parse_size

_TICKS = os.sysconf("SC_CLK_TCK")
VALUE_BYTES = 4096
WARM_KEYS = 200
TOUCH_BYTES = 4 << 20


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("mooncake-cpu", help="per call: wall time and CPU of "
                              "client, master and node, kvpool vs the real Mooncake")
    p.add_argument("--ops", type=int, default=3000, help="calls per operation")
    p.add_argument("--impl", choices=("both", "kvpool", "mooncake"), default="both")
    p.add_argument("--size", default="4KiB", help="bytes per object")
    p.add_argument("--batch", type=int, default=1,
                   help="keys per call (above 1: the batch_* calls)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    impls = ["kvpool", "mooncake"] if args.impl == "both" else [args.impl]
    size = parse_size(args.size)
    if size <= 0 or args.batch < 1 or args.ops < 1:
        raise SystemExit("--size, --batch and --ops must be positive")
    print(f"{'impl':9}{'op':16}{'wall us':>9}  {'client':>9}{'master':>9}{'node':>9}"
          f"   (CPU us per call, user/system; {args.batch} x {size} B per call)")
    for impl in impls:
        for line in measure(impl, args.ops, size, args.batch):
            print(line, flush=True)
    with raw_socket() as raw:
        _, rate = raw.round_trips(64, args.ops)
    print(f"{'raw-tcp':9}{'64 B rtt':16}{1e6 / rate:9.1f}  (a blocking Python socket "
          "round trip between two processes, the anchor)")
    return 0


def measure(impl: str, ops: int, size: int = VALUE_BYTES, batch: int = 1) -> Iterator[str]:
    # the node holds the warm keys and every put (fresh keys each), with room to spare
    dram = max(64 << 20, (WARM_KEYS * size + 2 * (ops + 200) * batch * size) * 5 // 4)
    with ExitStack() as stack:
        master, master_pid = stack.enter_context(master_process(impl))
        node_pid = stack.enter_context(node_process(impl, master, dram))
        store = load(impl)[0].MooncakeDistributedStore()
        if store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", master) != 0:
            raise RuntimeError(f"{impl} store setup failed")
        # registered: alive until the store closes
        buf = np.zeros(max(TOUCH_BYTES, 2 * batch * size), dtype=np.uint8)
        try:
            store.register_buffer(int(buf.ctypes.data), buf.nbytes)
            _touch(store, int(buf.ctypes.data), dram)
            calls = _operations(store, buf, size) if batch == 1 else \
                _batched(store, buf, size, batch)
            for op, call in calls.items():
                yield _one(impl, op, call, ops, master_pid, node_pid)
        finally:
            store.close()


def _touch(store: Any, ptr: int, dram: int) -> None:
    """Write the node's whole memory once and free it again, so that no implementation's
    puts pay for its first page faults in the timed loops."""
    for i in range(dram * 9 // 10 // TOUCH_BYTES):
        if store.put_from(f"touch-{i}", ptr, TOUCH_BYTES) != 0:
            break
    store.remove_all()
    time.sleep(0.3)  # the read leases (200 ms here) of removed objects end


def _batched(store: Any, buf: np.ndarray, size: int,
             batch: int) -> dict[str, Callable[[int], Any]]:
    ptr = int(buf.ctypes.data)
    srcs, dsts = [ptr + j * size for j in range(batch)], \
        [ptr + (batch + j) * size for j in range(batch)]
    sizes = [size] * batch
    groups = [[f"warm-{(g * batch + j) % WARM_KEYS}" for j in range(batch)]
              for g in range(max(1, WARM_KEYS // batch))]
    for g in groups:
        _check(store.batch_put_from(g, srcs, sizes), 0, "batch_put_from")
    stamp = time.perf_counter_ns

    def put(i: int) -> None:
        t = stamp()
        _check(store.batch_put_from([f"p-{i}-{t}-{j}" for j in range(batch)], srcs, sizes),
               0, "batch_put_from")
    return {
        "batch_is_exist": lambda i: store.batch_is_exist(groups[i % len(groups)]),
        "batch_get_into": lambda i: _check(
            store.batch_get_into(groups[i % len(groups)], dsts, sizes), size,
            "batch_get_into"),
        "batch_put_from": put,
    }


def _check(got: list[int], want: int, what: str) -> None:
    if any(g != want for g in got):
        raise RuntimeError(f"{what} failed: {got[:4]}")


def _operations(store: Any, buf: np.ndarray,
                size: int = VALUE_BYTES) -> dict[str, Callable[[int], Any]]:
    ptr = int(buf.ctypes.data)
    value = bytes(size)
    for i in range(WARM_KEYS):
        store.put(f"warm-{i}", value)
    stamp = time.perf_counter_ns

    return {  # puts take fresh keys: Mooncake answers a put of an existing key at once
        "is_exist": lambda i: store.is_exist(f"warm-{i % WARM_KEYS}"),
        "get": lambda i: store.get(f"warm-{i % WARM_KEYS}"),
        "put": lambda i: store.put(f"p-{i}-{stamp()}", value),
        "get_into": lambda i: store.get_into(f"warm-{i % WARM_KEYS}", ptr, size),
        "put_from": lambda i: store.put_from(f"q-{i}-{stamp()}", ptr, size),
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
    return f"{impl:9}{op:16}{wall / ops * 1e6:9.1f}  {cols}"


def cpu_times(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of a process so far."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) / _TICKS, int(fields[12]) / _TICKS
