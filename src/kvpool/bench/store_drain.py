"""Drain rate: `python -m kvpool.bench.store_drain --objects 2000 --size 64KiB`.

Starts a master and two store nodes, puts `--objects` objects of `--size` on the first node,
drains it with `kvpool store-node drain` (its own process, as an operator runs it), then
kills the drained node with SIGKILL and reads every object back, checking the bytes. Prints
the drain command's summary (objects/s and MB/s of the moves) and the wall time of the whole
command (process start included).
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time
from contextlib import ExitStack

import numpy as np

from kvpool.launch.store import start_all_ready, start_master
from kvpool.launch.wait import wait_for
from kvpool.store.client.config import ClientConfig
from kvpool.store.client.rpc import RpcClient
from kvpool.store.client.store_client import StoreClient
from kvpool.store.config import ReplicateConfig
from kvpool.store.wire.messages import SegmentRow, SegmentsMsg
from kvpool.units import parse_size

BATCH = 64


def _value(i: int, size: int) -> bytes:
    return np.full(size, i % 251, dtype=np.uint8).tobytes()


def _start(stack: ExitStack, dram: str) -> tuple[str, list[subprocess.Popen[bytes]]]:
    _, master, _ = start_master(stack, "--client_ttl", "2")
    nodes = start_all_ready(stack, [("store-node", "--dram", dram, "--master", master)] * 2,
                            "a store node", show_errors=True)  # announced once mounted
    return master, nodes


def _segments(master: str) -> list[SegmentRow]:
    with RpcClient(master, "bench-probe") as probe:
        return list(probe.call(SegmentsMsg()))


def _wait_segments(master: str, count: int, timeout_s: float = 60.0) -> None:
    wait_for(lambda: len(_segments(master)) == count, timeout_s,
             f"{count} mounted segments", 0.1)


def _fill(store: StoreClient, endpoint: str, num: int, size: int) -> None:
    cfg = ReplicateConfig(preferred_segments=(endpoint,))
    for lo in range(0, num, BATCH):
        keys = [f"drain-{i}" for i in range(lo, min(num, lo + BATCH))]
        results = store.put_batch(keys, [_value(lo + j, size) for j in range(len(keys))], cfg)
        if not all(r.ok for r in results):
            raise RuntimeError(f"put failed: {results[0]}")


def _verify(store: StoreClient, num: int, size: int) -> int:
    bad = 0
    for lo in range(0, num, BATCH):
        keys = [f"drain-{i}" for i in range(lo, min(num, lo + BATCH))]
        for j, got in enumerate(store.get_batch(keys)):
            bad += not (got.ok and got.data == _value(lo + j, size))
    return bad


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvpool.bench.store_drain")
    p.add_argument("--objects", type=int, default=2000)
    p.add_argument("--size", default="64KiB")
    p.add_argument("--dram", default="1GiB", help="memory of each of the two store nodes")
    args = p.parse_args(argv)
    size = parse_size(args.size)
    with ExitStack() as stack:
        master, nodes = _start(stack, args.dram)
        endpoint, owner = _segments(master)[0].endpoint, _segments(master)[0].client_id
        drained = next(n for n in nodes if f"-{n.pid}-" in owner)
        store = stack.enter_context(StoreClient(ClientConfig(master=master)))
        _fill(store, endpoint, args.objects, size)
        t0 = time.monotonic()
        out = subprocess.run([sys.executable, "-m", "kvpool", "store-node", "drain", endpoint,
                              "--master", master], capture_output=True, text=True, check=False)
        wall = time.monotonic() - t0
        print(out.stdout.splitlines()[-1] if out.stdout else out.stderr)
        drained.send_signal(signal.SIGKILL)
        drained.wait()
        _wait_segments(master, 1)
        bad = _verify(store, args.objects, size)
        print(f"drain command: exit {out.returncode}, {wall:.2f}s wall; after kill -9 of the "
              f"drained node: {args.objects - bad}/{args.objects} objects read back exact")
        return 0 if out.returncode == 0 and bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
