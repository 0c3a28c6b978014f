"""`kvpool bench store`: put/get throughput of the KV store, kvpool beside Mooncake.

A pure client (contributing no memory) in this process runs the workload against a store
node in another process: zero-copy single-key and batched puts and gets, 4 KiB to 16 MiB.
When the Mooncake wheel is importable, the identical workload runs through
`MooncakeDistributedStore` against its own `mooncake_master` and store-node process
(metadata P2PHANDSHAKE, protocol tcp). `--master-only` measures the master's metadata path.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from typing import Any

import numpy as np

from kvpool.bench import anchors
from kvpool.launch.children import running
from kvpool.launch.ports import free_port
from kvpool.launch.store import start_master, start_ready
from kvpool.launch.wait import wait_port
from kvpool.units import format_size, parse_size

Record = dict[str, Any]
NODE_READY = "node-ready"
LEASE_MS = 2000
"""Read lease of the kvpool master here: short, so memory of cleared phases is reused soon."""
MOONCAKE_NODE = """
import sys
from mooncake.store import MooncakeDistributedStore
store = MooncakeDistributedStore()
rc = store.setup("127.0.0.1", "P2PHANDSHAKE", int(sys.argv[2]), 16 << 20, "tcp", "",
                 sys.argv[1])
print("node-ready" if rc == 0 else f"setup failed {rc}", flush=True)
sys.stdin.read()
store.close()
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("store", help="KV store put/get throughput, kvpool vs Mooncake")
    p.add_argument("--sizes", default="4KiB,64KiB,1MiB,16MiB", help="object sizes")
    p.add_argument("--batch", type=int, default=32, help="keys per batched call")
    p.add_argument("--phase-bytes", default="128MiB", help="bytes moved per measurement")
    p.add_argument("--lease-ms", type=int, default=LEASE_MS,
                   help="read lease of the kvpool master: memory of force-removed objects "
                   "is reused when it ends (Mooncake runs with its default)")
    p.add_argument("--only", choices=("kvpool", "mooncake"), default=None,
                   help="run one system only")
    p.add_argument("--repeat", type=int, default=3,
                   help="timed rounds (systems and anchors alternate); medians reported")
    p.add_argument("--max-ops", type=int, default=2000, help="cap on objects per measurement")
    p.add_argument("--dram", default="1GiB", help="memory of the store node")
    p.add_argument("--protocol", default="auto", choices=("auto", "tcp", "shm"),
                   help="kvpool transport (Mooncake always uses tcp)")
    p.add_argument("--no-mooncake", action="store_true", help="skip the Mooncake comparison")
    p.add_argument("--master-only", action="store_true", help="benchmark the master alone")
    p.add_argument("--seconds", type=float, default=2.0, help="duration of master-only runs")
    p.add_argument("--clients", type=int, default=4,
                   help="concurrent client processes in the master-only RPC run")
    p.add_argument("--checksums", choices=("both", "on", "off"), default="both",
                   help="kvpool with xxh3 checksums on (hash on put, verify on get), off, "
                   "or both in the same run (the off run is reported as kvpool-nosum)")
    p.add_argument("--json", action="store_true", help="one JSON object per measurement")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    emit = _emitter(args.json)
    if args.master_only:
        from kvpool.bench.store_master import bench_master
        for record in bench_master(args.seconds, args.clients):
            emit(record)
        return 0
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    systems: list[tuple[str, Callable[[ExitStack, int, int], Any]]] = [
        ("kvpool", functools.partial(_kvpool_systems, checksums=args.checksums,
                                     protocol=args.protocol))]
    if not args.no_mooncake and _mooncake_available():
        systems.append(("mooncake", _mooncake_system))
    elif not args.no_mooncake:
        print("mooncake.store is not importable: kvpool only", file=sys.stderr)
    results: list[Record] = []
    with ExitStack() as stack:
        named: list[tuple[str, Any]] = []
        for name, factory in systems:
            if not args.only or name == args.only:
                found = factory(stack, parse_size(args.dram), args.lease_ms)
                named += found if isinstance(found, list) else [(name, found)]
        raw = stack.enter_context(anchors.raw_socket())
        for record in _workload(named, sizes, args.batch, parse_size(args.phase_bytes),
                                args.max_ops, args.repeat, raw):
            results.append(record)
            emit(record)
    if not args.json:
        _print_ratios(results)
        _print_checksum_cost(results)
    return 0


# -- workload ---------------------------------------------------------------------------------

def _workload(systems: list[tuple[str, Any]], sizes: Sequence[int], batch: int,
              phase_bytes: int, max_ops: int, rounds: int,
              raw: anchors.RawSocket) -> Iterator[Record]:
    """For each size: one untimed warm round, then `rounds` timed rounds in which every
    system (kvpool with checksums on and off, Mooncake) and the anchors (raw socket, memcpy)
    take their turn, in an order rotating from round to round so load changes on this
    machine hit them alike. Each measurement reports its median round; kvpool's records
    carry the anchors of the same shape (`raw_socket_*`, `memcpy_gb_per_s`)."""
    largest = max(sizes) * batch
    src = np.random.default_rng(0).integers(0, 255, largest, dtype=np.uint8)
    dst = np.zeros(largest, dtype=np.uint8)
    addrs = {name: (system.register(src), system.register(dst)) for name, system in systems}
    for size in sizes:
        count = max(1, min(max_ops, phase_bytes // size))
        samples: dict[tuple[str, str, str], list[Record]] = {}
        turns = [*systems, ("anchors", None)]
        for attempt in range(rounds + 1):
            shift = attempt % len(turns)
            for name, system in turns[shift:] + turns[:shift]:
                recs = _anchor_pass(raw, size, count, batch) if system is None else _pass(
                    name, system, size, count, batch, src, dst, *addrs[name], attempt)
                for rec in recs if attempt else ():
                    samples.setdefault((rec["system"], rec["op"], rec["mode"]), []).append(rec)
        yield from _medians(samples, rounds)


def _medians(samples: dict[tuple[str, str, str], list[Record]],
             rounds: int) -> Iterator[Record]:
    """The median round of each measurement, anchors folded into kvpool's records."""
    med = {slot: sorted(recs, key=lambda r: r["ops_per_s"])[len(recs) // 2] | {
        "rounds": rounds} for slot, recs in samples.items()}
    for (system, _, mode), rec in med.items():
        if system in ("raw-socket", "memcpy"):
            continue
        raw = med.get(("raw-socket", "round_trip" if mode == "single" else "stream", mode))
        cpy = med.get(("memcpy", "copy", mode))
        if raw is not None:
            rec = rec | {"raw_socket_ops_per_s": raw["ops_per_s"],
                         "raw_socket_gb_per_s": raw["gb_per_s"]}
        if cpy is not None:
            rec = rec | {"memcpy_gb_per_s": cpy["gb_per_s"]}
        yield rec


def _anchor_pass(raw: anchors.RawSocket, size: int, count: int, batch: int) -> list[Record]:
    """A raw loopback socket and memcpy moving the same bytes as one pass."""
    groups = max(1, count // batch)
    _, reqs = raw.round_trips(size, count)
    out = [_record("raw-socket", "round_trip", "single", size, count, count / reqs)]
    _, reqs = raw.stream(size, batch, groups)
    out.append(_record("raw-socket", "stream", f"batch{batch}", size, groups * batch,
                       groups * batch / reqs))
    _, reqs = anchors.memcpy(size, batch, groups)
    out.append(_record("memcpy", "copy", f"batch{batch}", size, groups * batch,
                       groups * batch / reqs))
    return out


def _pass(name: str, system: Any, size: int, count: int, batch: int, src: np.ndarray,
          dst: np.ndarray, src_addr: int, dst_addr: int, attempt: int) -> list[Record]:
    keys = [f"{name}-s{size}-{i}-{attempt}" for i in range(count)]
    records = list(_single(name, system, keys, size, src_addr, dst_addr))
    assert np.array_equal(dst[:size], src[:size]), f"{name}: single get returned wrong bytes"
    system.clear()
    groups = [[f"{name}-b{size}-{r}-{i}-{attempt}" for i in range(batch)]
              for r in range(max(1, count // batch))]
    records += _batched(name, system, groups, size, src_addr, dst_addr)
    assert np.array_equal(dst[:batch * size], src[:batch * size]), \
        f"{name}: batched get returned wrong bytes"
    system.clear()
    return records


def _single(name: str, system: Any, keys: list[str], size: int, src: int,
            dst: int) -> Iterator[Record]:
    t0 = time.perf_counter()
    for key in keys:
        system.put(key, src, size)
    t1 = time.perf_counter()
    for key in keys:
        system.get(key, dst, size)
    t2 = time.perf_counter()
    yield _record(name, "put", "single", size, len(keys), t1 - t0)
    yield _record(name, "get", "single", size, len(keys), t2 - t1)


def _batched(name: str, system: Any, groups: list[list[str]], size: int, src: int,
             dst: int) -> Iterator[Record]:
    n = len(groups[0])
    addrs = [src + i * size for i in range(n)]
    daddrs = [dst + i * size for i in range(n)]
    t0 = time.perf_counter()
    for keys in groups:
        system.put_batch(keys, addrs, [size] * n)
    t1 = time.perf_counter()
    for keys in groups:
        system.get_batch(keys, daddrs, [size] * n)
    t2 = time.perf_counter()
    total = n * len(groups)
    yield _record(name, "put", f"batch{n}", size, total, t1 - t0)
    yield _record(name, "get", f"batch{n}", size, total, t2 - t1)


def _record(system: str, op: str, mode: str, size: int, ops: int, seconds: float) -> Record:
    return {"system": system, "op": op, "mode": mode, "size": size, "ops": ops,
            "seconds": round(seconds, 6), "ops_per_s": round(ops / seconds, 1),
            "gb_per_s": round(ops * size / seconds / 1e9, 4)}


# -- kvpool -----------------------------------------------------------------------------------

class _KvpoolAdapter:
    def __init__(self, client: Any, lease_ms: int) -> None:
        self.client = client
        self.lease_ms = lease_ms

    def register(self, arr: np.ndarray) -> int:
        return int(self.client.register_buffer(arr).addr)

    def put(self, key: str, addr: int, size: int) -> None:
        _check(self.client.put_from(key, addr, size).code, key)

    def get(self, key: str, addr: int, size: int) -> None:
        _check(self.client.get_into(key, addr, size).code, key)

    def put_batch(self, keys: list[str], addrs: list[int], sizes: list[int]) -> None:
        for key, r in zip(keys, self.client.batch_put_from(keys, addrs, sizes), strict=True):
            _check(r.code, key)

    def get_batch(self, keys: list[str], addrs: list[int], sizes: list[int]) -> None:
        for key, r in zip(keys, self.client.batch_get_into(keys, addrs, sizes), strict=True):
            _check(r.code, key)

    def clear(self) -> None:
        self.client.remove_all(force=True)
        time.sleep(self.lease_ms / 1000 + 0.1)  # force-removed memory is reused once leases end


def _check(code: int, key: str) -> None:
    if code != 0:
        raise RuntimeError(f"operation on {key!r} failed with code {int(code)}")


def _kvpool_systems(stack: ExitStack, dram: int, lease_ms: int, checksums: str = "both",
                    protocol: str = "auto") -> list[tuple[str, _KvpoolAdapter]]:
    """A master and a store node; one client with checksums on ("kvpool") and/or one with
    them off ("kvpool-nosum"), both against the same node."""
    from kvpool.store.client.config import ClientConfig
    from kvpool.store.client.store_client import StoreClient
    _, master, _ = start_master(stack, "--default_kv_lease_ttl", str(lease_ms))
    start_ready(stack, "store-node", "--dram", str(dram), "--master", master,
                what="the store node")  # announced once its memory is mounted
    out = []
    for name, on in (("kvpool", True), ("kvpool-nosum", False)):
        if checksums == "both" or (checksums == "on") == on:
            client = StoreClient(ClientConfig(master=master, local_buffer_size=0,
                                              write_checksums=on, verify_checksums=on,
                                              protocol=protocol))
            stack.callback(client.close)
            out.append((name, _KvpoolAdapter(client, lease_ms)))
    return out


# -- Mooncake ---------------------------------------------------------------------------------

def _mooncake_available() -> bool:
    try:
        import mooncake.store  # noqa: F401
    except ImportError:
        return False
    return _mooncake_master_binary() is not None


def _mooncake_master_binary() -> str | None:
    local = os.path.join(os.path.dirname(sys.executable), "mooncake_master")
    return local if os.path.exists(local) else shutil.which("mooncake_master")


class _MooncakeAdapter(_KvpoolAdapter):
    def register(self, arr: np.ndarray) -> int:
        addr = int(arr.ctypes.data)
        _check(self.client.register_buffer(addr, arr.nbytes), "register_buffer")
        return addr

    def put(self, key: str, addr: int, size: int) -> None:
        _check(self.client.put_from(key, addr, size), key)

    def get(self, key: str, addr: int, size: int) -> None:
        got = self.client.get_into(key, addr, size)
        _check(0 if got == size else got, key)

    def put_batch(self, keys: list[str], addrs: list[int], sizes: list[int]) -> None:
        for key, code in zip(keys, self.client.batch_put_from(keys, addrs, sizes), strict=True):
            _check(code, key)

    def get_batch(self, keys: list[str], addrs: list[int], sizes: list[int]) -> None:
        got = self.client.batch_get_into(keys, addrs, sizes)
        for key, n, size in zip(keys, got, sizes, strict=True):
            _check(0 if n == size else n, key)

    def clear(self) -> None:
        self.client.remove_all(True)  # Mooncake frees force-removed memory at once


def _mooncake_system(stack: ExitStack, dram: int, lease_ms: int) -> _MooncakeAdapter:
    os.environ.setdefault("GLOG_minloglevel", "2")  # before the wheel initialises glog
    from mooncake.store import MooncakeDistributedStore
    rpc, admin = free_port(), free_port()
    binary = _mooncake_master_binary()
    assert binary is not None
    stack.enter_context(running([binary, f"--rpc_port={rpc}", f"--metrics_port={admin}"],
                                stderr=subprocess.DEVNULL))
    wait_port(rpc)
    master = f"127.0.0.1:{rpc}"
    node = stack.enter_context(running([sys.executable, "-c", MOONCAKE_NODE, master,
                                         str(dram)], stdout=subprocess.PIPE,
                                        stdin=subprocess.PIPE, stderr=subprocess.DEVNULL))
    assert node.stdout is not None
    line = node.stdout.readline().decode().strip()
    if line != NODE_READY:
        raise RuntimeError(f"Mooncake store node did not start: {line!r}")
    client = MooncakeDistributedStore()
    rc = client.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", master)
    if rc != 0:
        raise RuntimeError(f"MooncakeDistributedStore.setup failed: {rc}")
    stack.callback(client.close)
    return _MooncakeAdapter(client, lease_ms)


# -- processes and output ---------------------------------------------------------------------

def _emitter(as_json: bool) -> Callable[[Record], None]:
    def emit(record: Record) -> None:
        if as_json:
            print(json.dumps(record), flush=True)
            return
        if "size" in record:
            print(f"{record['system']:9} {record['op']:4} {record['mode']:8} "
                  f"{format_size(record['size']):>8}  {record['ops_per_s']:>10.0f} ops/s "
                  f"{record['gb_per_s']:>8.3f} GB/s", flush=True)
        else:
            print(f"{record['system']:14} {record['op']:14} {record['mode']:12} "
                  f"{record['rate']:>12.0f} {record['unit']}", flush=True)
    return emit


def _print_ratios(results: list[Record]) -> None:
    """kvpool beside Mooncake and the anchors measured in the same rounds (ops/s; GB/s)."""
    ours = {(r["op"], r["mode"], r["size"]): r for r in results if r["system"] == "kvpool"}
    theirs = {(r["op"], r["mode"], r["size"]): r for r in results if r["system"] == "mooncake"}
    print("\nmedians of alternating rounds: kvpool, mooncake, raw socket, memcpy "
          "(ops/s, GB/s)")
    for key, r in ours.items():
        mc = theirs.get(key)
        raw_ops, raw_gb = r.get("raw_socket_ops_per_s"), r.get("raw_socket_gb_per_s")
        line = f"  {key[0]:4} {key[1]:8} {format_size(key[2]):>8}  kvpool " \
            f"{r['ops_per_s']:>9.0f} {r['gb_per_s']:6.2f}"
        if mc is not None:
            line += f"  mooncake {mc['ops_per_s']:>9.0f} {mc['gb_per_s']:6.2f}  " \
                f"x{r['ops_per_s'] / mc['ops_per_s']:.2f}"
        if raw_ops:
            line += f"  raw {raw_ops:>9.0f} {raw_gb:6.2f} x{r['ops_per_s'] / raw_ops:.2f}"
        if r.get("memcpy_gb_per_s"):
            line += f"  memcpy {r['memcpy_gb_per_s']:6.2f} " \
                f"x{r['gb_per_s'] / r['memcpy_gb_per_s']:.2f}"
        print(line)


def _print_checksum_cost(results: list[Record]) -> None:
    """Checksums on (kvpool) against off (kvpool-nosum), measured in the same run."""
    on = {(r["op"], r["mode"], r["size"]): r for r in results if r["system"] == "kvpool"}
    off = {(r["op"], r["mode"], r["size"]): r for r in results if r["system"] == "kvpool-nosum"}
    if not on or not off:
        return
    print("\nchecksums (xxh3_64: hash on put, verify on get): on / off")
    for key, r in on.items():
        if key in off:
            print(f"  {key[0]:4} {key[1]:8} {format_size(key[2]):>8}  "
                  f"on {r['gb_per_s']:.3f} GB/s  off {off[key]['gb_per_s']:.3f} GB/s  "
                  f"x{r['ops_per_s'] / off[key]['ops_per_s']:.2f}")
