"""`kvpool bench mooncake-api`: the store and transfer benchmarks through Mooncake's Python
API, for kvpool (kvpool.compat over `kvpool master`) and for the real Mooncake wheel (over its
`mooncake_master`) in one run, with identical client code (kvpool.compat.bench_client).

Each implementation gets its own master (started with the same Mooncake flags), a memory node
process and a pure-client process; the client measures batched put/get/exist through the store
and batched write/read through TransferEngine (tcp, loopback). Ratios are kvpool / Mooncake.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from kvpool.bench.common import Measurement, emit
from kvpool.procs import free_port, stop, wait_port
from kvpool.units import parse_size

_CLIENT = "kvpool.compat.bench_client"


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("mooncake-api", help="store and transfer through Mooncake's API: "
                              "kvpool vs the real Mooncake")
    p.add_argument("--sizes", default="64KiB,1MiB", help="object / request sizes")
    p.add_argument("--batch", type=int, default=16, help="keys or requests per call")
    p.add_argument("--phase-bytes", default="128MiB", help="bytes put per store measurement")
    p.add_argument("--dram", default="512MiB", help="memory of the store node")
    p.add_argument("--seconds", type=float, default=1.0, help="time per transfer measurement")
    p.add_argument("--impl", choices=("both", "kvpool", "mooncake"), default="both")
    p.add_argument("--json", action="store_true", help="one JSON object per measurement")
    p.set_defaults(func=run)


def mooncake_master_binary() -> Path | None:
    """The `mooncake_master` shipped in the real wheel's package directory, if installed."""
    spec = importlib.util.find_spec("mooncake")
    for location in (spec.submodule_search_locations or []) if spec else []:
        binary = Path(location) / "mooncake_master"
        if binary.is_file():
            return binary
    return None


def run(args: argparse.Namespace) -> int:
    impls = ["kvpool", "mooncake"] if args.impl == "both" else [args.impl]
    if "mooncake" in impls and mooncake_master_binary() is None:
        print("the real Mooncake wheel is not installed: kvpool only", file=sys.stderr)
        impls.remove("mooncake")
    if not impls:
        return 1
    sizes = ",".join(str(parse_size(s)) for s in args.sizes.split(","))
    results: list[Measurement] = []
    for impl in impls:
        with ExitStack() as stack:
            master = stack.enter_context(_master(impl))
            stack.enter_context(_node(impl, master, parse_size(args.dram)))
            results += _client(impl, master, sizes, args.batch, parse_size(args.phase_bytes),
                               args.seconds)
    add_ratios(results)
    emit(results, args.json)
    return 0


def add_ratios(results: list[Measurement]) -> None:
    """Set kvpool rows' ratio to kvpool / Mooncake (GB/s, or req/s for exist)."""
    anchors = {(m.bench, m.op, m.size_bytes): m for m in results if m.impl == "mooncake"}
    for m in results:
        anchor = anchors.get((m.bench, m.op, m.size_bytes))
        if m.impl != "kvpool" or anchor is None:
            continue
        mine, theirs = (m.req_per_s, anchor.req_per_s) if m.op == "exist" else \
            (m.gb_per_s, anchor.gb_per_s)
        if theirs > 0:
            m.anchor, m.ratio = "mooncake", mine / theirs


@contextmanager
def _master(impl: str) -> Iterator[str]:
    rpc = free_port()
    flags = [f"--rpc_port={rpc}", f"--metrics_port={free_port()}",
             "--enable_http_metadata_server=false", "--default_kv_lease_ttl=200"]
    binary = mooncake_master_binary()
    command = [str(binary), *flags] if impl == "mooncake" and binary else \
        [sys.executable, "-m", "kvpool", "--log-level", "WARNING", "master", *flags]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_port(rpc)
        yield f"127.0.0.1:{rpc}"
    finally:
        stop(proc, 5.0)


@contextmanager
def _node(impl: str, master: str, dram: int) -> Iterator[None]:
    proc = subprocess.Popen([sys.executable, "-m", _CLIENT, "node", impl, master, str(dram)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None
        announced = json.loads(proc.stdout.readline() or "{}")
        if not announced.get("ready"):
            raise RuntimeError(f"{impl} store node did not start: {announced}")
        yield
    finally:
        if proc.stdin:
            proc.stdin.close()
        stop(proc, 10)


def _client(impl: str, master: str, sizes: str, batch: int, phase_bytes: int,
            seconds: float) -> list[Measurement]:
    done = subprocess.run([sys.executable, "-m", _CLIENT, "client", impl, master, sizes,
                           str(batch), str(phase_bytes), str(seconds)],
                          capture_output=True, text=True, timeout=600)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("[")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{impl} client failed: {done.stderr[-2000:]}")
    rows: list[dict[str, Any]] = json.loads(lines[-1])
    return [Measurement(**row) for row in rows]


