"""`kvpool bench transfer`: write/read GB/s and req/s by size, single and batched, per transport.

The target is another process. Anchors measured in the same run: a raw Python socket stream over
loopback (for tcp), numpy memcpy (for shm), and the real Mooncake engine through its Python API
(tcp) when the `mooncake-transfer-engine-non-cuda` wheel is installed.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import socket
import struct
from collections.abc import Callable

import numpy as np

from kvpool.bench.common import Measurement, child, emit, rate
from kvpool.transfer import OpCode, TransferConfig, TransferEngine, TransferRequest

PEERS = "kvpool.bench.transfer_peers"
FULL_SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20]
QUICK_SIZES = [4 << 10, 64 << 10, 1 << 20, 8 << 20]
ARENA_BYTES = 64 << 20


def batch_count(size: int) -> int:
    return max(4, min(1024, ARENA_BYTES // size // 2))


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("transfer", help="transfer engine throughput vs raw socket, memcpy, Mooncake")
    p.add_argument("--quick", action="store_true", help="4 sizes, short timings")
    p.add_argument("--sizes", default=None, help="comma-separated sizes in bytes (default: 4 KiB..16 MiB)")
    p.add_argument("--transports", default="tcp,shm")
    p.add_argument("--no-mooncake", action="store_true", help="skip the Mooncake comparison")
    p.add_argument("--seconds", type=float, default=None, help="time per measurement")
    p.add_argument("--json", action="store_true", help="one JSON object per measurement")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else (QUICK_SIZES if args.quick else FULL_SIZES)
    seconds = args.seconds or (0.25 if args.quick else 0.6)
    results: list[Measurement] = []

    def out(ms: list[Measurement]) -> None:
        results.extend(ms)
        emit(ms, args.json)
    if not args.json:
        print(f"{'impl':<10} {'trans':<5} {'op':<5} {'mode':<7} {'size':>8} {'throughput':>13} {'rate':>17}  ratio")
    raw = bench_raw(sizes, seconds)
    out(raw)
    copy = bench_memcpy(sizes, seconds)
    out(copy)
    mooncake: list[Measurement] = []
    if not args.no_mooncake and importlib.util.find_spec("mooncake") is not None:
        mooncake = bench_mooncake(sizes, seconds)
        _ratio(mooncake, raw, "raw-socket")
        out(mooncake)
    for transport in args.transports.split(","):
        ms = bench_kvpool(transport, sizes, seconds)
        _ratio(ms, mooncake if (transport == "tcp" and mooncake) else (raw if transport == "tcp" else copy),
               "mooncake" if (transport == "tcp" and mooncake) else ("raw-socket" if transport == "tcp" else "memcpy"))
        out(ms)
    if not args.json:
        print_goals(results)
    return 0


def _ratio(ms: list[Measurement], anchors: list[Measurement], name: str) -> None:
    for m in ms:
        for a in anchors:
            if a.size_bytes == m.size_bytes and a.mode == m.mode and a.op in (m.op, "both") and a.gb_per_s:
                m.anchor, m.ratio = name, m.gb_per_s / a.gb_per_s


def bench_kvpool(transport: str, sizes: list[int], seconds: float) -> list[Measurement]:
    results = []
    with child(PEERS, "kvpool", str(ARENA_BYTES)) as peer, \
            TransferEngine(TransferConfig(protocol="tcp" if transport == "tcp" else "auto")) as engine:
        local = engine.allocate_managed(ARENA_BYTES)
        local.numpy()[:] = 7
        for size in sizes:
            for op in (OpCode.WRITE, OpCode.READ):
                for mode, count in (("single", 1), ("batched", batch_count(size))):
                    reqs = [TransferRequest(op, local.addr + i * size, size, peer["segment"], peer["addr"] + i * size)
                            for i in range(count)]
                    gbs, rps = rate(_checked(engine, reqs), size * count, count, seconds)
                    results.append(Measurement("transfer", "kvpool", transport, op.name.lower(), mode, size, gbs, rps))
    return results


def _checked(engine: TransferEngine, reqs: list[TransferRequest]) -> Callable[[], None]:
    def call() -> None:
        statuses = engine.transfer_sync(reqs)
        if not all(s.ok for s in statuses):
            raise RuntimeError(f"benchmark transfer failed: {statuses[0].reason}")
    return call


def bench_mooncake(sizes: list[int], seconds: float) -> list[Measurement]:
    os.environ.setdefault("GLOG_minloglevel", "2")  # quiet the C++ engine's INFO/WARNING lines
    from mooncake.engine import TransferEngine as MooncakeEngine

    results = []
    with child(PEERS, "mooncake", str(ARENA_BYTES)) as peer:
        engine = MooncakeEngine()
        engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
        local = engine.allocate_managed_buffer(ARENA_BYTES)
        for size in sizes:
            for op in ("write", "read"):
                fn = engine.batch_transfer_sync_write if op == "write" else engine.batch_transfer_sync_read
                for mode, count in (("single", 1), ("batched", batch_count(size))):
                    args = (peer["segment"], [local + i * size for i in range(count)],
                            [peer["addr"] + i * size for i in range(count)], [size] * count)
                    gbs, rps = rate(_mooncake_call(fn, args), size * count, count, seconds)
                    results.append(Measurement("transfer", "mooncake", "tcp", op, mode, size, gbs, rps))
    return results


def _mooncake_call(fn: Callable[..., int], args: tuple[object, ...]) -> Callable[[], None]:
    def call() -> None:
        if fn(*args) != 0:
            raise RuntimeError("mooncake transfer failed")
    return call


def bench_raw(sizes: list[int], seconds: float) -> list[Measurement]:
    results = []
    source = memoryview(bytearray(max(sizes)))
    with child(PEERS, "raw", str(max(sizes))) as peer:
        sock = socket.create_connection(("127.0.0.1", peer["port"]))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for size in sizes:
            for mode, count in (("single", 1), ("batched", batch_count(size))):
                gbs, rps = rate(_raw_call(sock, source[:size], count), size * count, count, seconds)
                results.append(Measurement("transfer", "raw-socket", "tcp", "both", mode, size, gbs, rps))
        sock.close()
    return results


def _raw_call(sock: socket.socket, payload: memoryview, count: int) -> Callable[[], None]:
    head = struct.pack("<II", payload.nbytes, count)

    def call() -> None:
        sock.sendall(head)
        for _ in range(count):
            sock.sendall(payload)
        if sock.recv(1) != b"k":
            raise RuntimeError("raw socket sink went away")
    return call


def bench_memcpy(sizes: list[int], seconds: float) -> list[Measurement]:
    src = np.full(ARENA_BYTES, 3, dtype=np.uint8)
    dst = np.zeros(ARENA_BYTES, dtype=np.uint8)
    results = []
    for size in sizes:
        for mode, count in (("single", 1), ("batched", batch_count(size))):
            def call(size: int = size, count: int = count) -> None:
                for i in range(count):
                    np.copyto(dst[i * size : (i + 1) * size], src[i * size : (i + 1) * size])
            gbs, rps = rate(call, size * count, count, seconds)
            results.append(Measurement("transfer", "memcpy", "shm", "both", mode, size, gbs, rps))
    return results


def print_goals(results: list[Measurement]) -> None:
    def find(impl: str, transport: str, op: str, mode: str, size: int) -> Measurement | None:
        for m in results:
            if (m.impl, m.transport, m.mode, m.size_bytes) == (impl, transport, mode, size) and m.op in (op, "both"):
                return m
        return None

    print("\ngoals (ratios within this run):")
    for m in results:
        if m.impl != "kvpool":
            continue
        base = find("raw-socket", "tcp", m.op, m.mode, m.size_bytes) if m.transport == "tcp" \
            else find("memcpy", "shm", m.op, m.mode, m.size_bytes)
        moon = find("mooncake", "tcp", m.op, m.mode, m.size_bytes)
        parts = [f"kvpool {m.transport} {m.op} {m.mode} {m.size_bytes >> 10} KiB:"]
        if base:
            parts.append(f"{m.gb_per_s / base.gb_per_s:.2f}x {base.impl}")
        if moon and m.transport == "tcp":
            parts.append(f"{m.req_per_s / moon.req_per_s:.2f}x mooncake")
        print("  " + " ".join(parts))
