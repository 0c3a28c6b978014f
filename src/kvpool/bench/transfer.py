"""`kvpool bench transfer`: kvpool's transfer engine against its anchors, in alternating rounds.

The target is always another process. Anchors, measured in the same run and interleaved with
kvpool: the real Mooncake engine over tcp (when the `mooncake-transfer-engine-non-cuda` wheel is
installed), a raw Python socket stream over loopback (tcp), and numpy memcpy (shm). Each round
measures every case once for every implementation, in a rotating order, so that load from other
work on the machine falls on all of them alike; the table shows the median of the rounds and the
ratios of those medians. Only ratios within one run mean anything on a shared machine.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import socket
import statistics
import struct
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass

import numpy as np

from kvpool.bench.common import Measurement, child, emit, goal_line, print_goals, rate
from kvpool.bench.transfer_peers import raw_offsets
from kvpool.transfer import OpCode, TransferConfig, TransferEngine, TransferRequest
from kvpool.units import format_size

PEERS = "kvpool.bench.transfer_peers"
FULL_SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 8 << 20, 16 << 20]
QUICK_SIZES = [4 << 10, 64 << 10, 1 << 20, 8 << 20]
ARENA_BYTES = 64 << 20
OPS = ("write", "read")
MODES = ("single", "batched")
Call = Callable[[], None]


def batch_count(size: int) -> int:
    return max(4, min(1024, ARENA_BYTES // size // 2))


@dataclass(frozen=True)
class Case:
    size: int
    op: str
    mode: str

    @property
    def count(self) -> int:
        return 1 if self.mode == "single" else batch_count(self.size)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("transfer", help="transfer engine vs Mooncake, raw socket, memcpy")
    p.add_argument("--quick", action="store_true", help="4 sizes, 3 short rounds")
    p.add_argument("--sizes", default=None, help="comma-separated sizes in bytes (default: 4 KiB..16 MiB)")
    p.add_argument("--transports", default="tcp,shm")
    p.add_argument("--no-mooncake", action="store_true", help="skip the Mooncake comparison")
    p.add_argument("--seconds", type=float, default=None, help="time per measurement")
    p.add_argument("--rounds", type=int, default=None,
                   help="alternating rounds; the table shows medians (default 3 quick, 5 full)")
    p.add_argument("--json", action="store_true", help="one JSON object per measurement (medians)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    quick = bool(getattr(args, "quick", False))
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else (QUICK_SIZES if quick else FULL_SIZES)
    seconds = args.seconds or (0.15 if quick else 0.3)
    rounds = getattr(args, "rounds", None) or (3 if quick else 5)
    transports = args.transports.split(",")
    with_mooncake = not args.no_mooncake and "tcp" in transports and mooncake_installed()
    cases = [Case(size, op, mode) for size in sizes for op in OPS for mode in MODES]
    with ExitStack() as stack:
        impls = start_impls(stack, transports, with_mooncake, sizes)
        samples = measure_rounds(impls, cases, rounds, seconds)
    results = medians(samples, cases)
    if args.json:
        emit(results, True)
    else:
        print_table(results, rounds, seconds)
        print_goals(goal_lines(results))
    return 0


def mooncake_installed() -> bool:
    return importlib.util.find_spec("mooncake") is not None


# -- implementations: (impl, transport) -> case -> call ----------------------------------------

Impl = tuple[str, str]
"""(who, transport): ("kvpool", "tcp"), ("mooncake", "tcp"), ("raw-socket", "tcp"), ("memcpy", "shm")."""


def start_impls(stack: ExitStack, transports: list[str], with_mooncake: bool,
                sizes: list[int]) -> dict[Impl, Callable[[Case], Call]]:
    """Start every peer process and initiator once; they serve all rounds."""
    impls: dict[Impl, Callable[[Case], Call]] = {}
    if "tcp" in transports:
        impls["raw-socket", "tcp"] = raw_socket(stack, ARENA_BYTES)
        if with_mooncake:
            impls["mooncake", "tcp"] = mooncake(stack)
    if "shm" in transports:
        impls["memcpy", "shm"] = memcpy()
    if transports:
        peer = stack.enter_context(child(PEERS, "kvpool", str(ARENA_BYTES)))
        for transport in transports:
            impls["kvpool", transport] = kvpool(stack, transport, peer)
    return impls


def kvpool(stack: ExitStack, transport: str, peer: dict[str, int | str]) -> Callable[[Case], Call]:
    config = TransferConfig(protocol="tcp" if transport == "tcp" else "auto")
    engine = stack.enter_context(TransferEngine(config))
    local = engine.allocate_managed(ARENA_BYTES)
    local.numpy()[:] = 7
    segment, base = str(peer["segment"]), int(peer["addr"])

    def call_for(case: Case) -> Call:
        op = OpCode.WRITE if case.op == "write" else OpCode.READ
        reqs = [TransferRequest(op, local.addr + i * case.size, case.size, segment, base + i * case.size)
                for i in range(case.count)]

        def call() -> None:
            statuses = engine.transfer_sync(reqs)
            if not all(s.ok for s in statuses):
                raise RuntimeError(f"benchmark transfer failed: {statuses[0].reason}")
        return call
    return call_for


def mooncake(stack: ExitStack) -> Callable[[Case], Call]:
    os.environ.setdefault("GLOG_minloglevel", "2")  # quiet the C++ engine's INFO/WARNING lines
    from mooncake.engine import TransferEngine as MooncakeEngine

    peer = stack.enter_context(child(PEERS, "mooncake", str(ARENA_BYTES)))
    engine = MooncakeEngine()
    if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        raise RuntimeError("mooncake engine failed to initialize")
    local = engine.allocate_managed_buffer(ARENA_BYTES)
    segment, base = str(peer["segment"]), int(peer["addr"])

    def call_for(case: Case) -> Call:
        fn = engine.batch_transfer_sync_write if case.op == "write" else engine.batch_transfer_sync_read
        args = (segment, [local + i * case.size for i in range(case.count)],
                [base + i * case.size for i in range(case.count)], [case.size] * case.count)

        def call() -> None:
            if fn(*args) != 0:
                raise RuntimeError("mooncake transfer failed")
        return call
    return call_for


def raw_socket(stack: ExitStack, arena: int) -> Callable[[Case], Call]:
    """The loopback anchor: the bytes of a case as plain socket sends, one ack per call. A
    batch's messages come from distinct places of an `arena` of memory and land in distinct
    places of the sink's, as the engines' batches read and write distinct buffers (one message
    sent from and received into the same place each time stays in the CPU's caches, which a
    batch of distinct buffers cannot)."""
    peer = stack.enter_context(child(PEERS, "raw", str(arena)))
    sock = stack.enter_context(socket.create_connection(("127.0.0.1", int(peer["port"]))))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    source = memoryview(bytearray(arena))

    def call_for(case: Case) -> Call:
        head = struct.pack("<II", case.size, case.count)
        payloads = [source[at:at + case.size] for at in raw_offsets(case.size, case.count, arena)]

        def call() -> None:
            sock.sendall(head)
            for payload in payloads:
                sock.sendall(payload)
            if sock.recv(1) != b"k":
                raise RuntimeError("raw socket sink went away")
        return call
    return call_for


def memcpy() -> Callable[[Case], Call]:
    src = np.full(ARENA_BYTES, 3, dtype=np.uint8)
    dst = np.zeros(ARENA_BYTES, dtype=np.uint8)

    def call_for(case: Case) -> Call:
        size, count = case.size, case.count

        def call() -> None:
            for i in range(count):
                np.copyto(dst[i * size : (i + 1) * size], src[i * size : (i + 1) * size])
        return call
    return call_for


# -- rounds and medians ------------------------------------------------------------------------

Samples = dict[tuple[Impl, Case], list[tuple[float, float]]]


def measure_rounds(impls: dict[Impl, Callable[[Case], Call]], cases: list[Case], rounds: int,
                   seconds: float) -> Samples:
    """Every round measures each case with every implementation back to back, in an order that
    rotates from round to round."""
    names = list(impls)
    samples: Samples = {}
    for r in range(rounds):
        for case in cases:
            for name in rotated(names, r):
                call = impls[name](case)
                samples.setdefault((name, case), []).append(
                    rate(call, case.size * case.count, case.count, seconds))
    return samples


def rotated(names: list[Impl], r: int) -> list[Impl]:
    k = r % len(names) if names else 0
    return names[k:] + names[:k]


def medians(samples: Samples, cases: list[Case]) -> list[Measurement]:
    """One Measurement per implementation and case: the median GB/s and req/s of its rounds,
    with its ratio to the anchor of its transport (Mooncake for tcp if present, else the raw
    socket; memcpy for shm), in the order of `cases`."""
    rows: dict[tuple[Impl, Case], Measurement] = {}
    for ((impl, transport), case), runs in samples.items():
        gbs = statistics.median(g for g, _ in runs)
        rps = statistics.median(r for _, r in runs)
        rows[(impl, transport), case] = Measurement("transfer", impl, transport, case.op, case.mode,
                                                    case.size, gbs, rps)
    for ((impl, transport), case), m in rows.items():
        for anchor in ANCHORS.get((impl, transport), ()):
            found = rows.get((anchor, case))
            if found is not None and found.gb_per_s:
                m.anchor, m.ratio = found.impl, m.gb_per_s / found.gb_per_s
                break
    order = {c: i for i, c in enumerate(cases)}
    return sorted(rows.values(), key=lambda m: (m.impl, m.transport,
                                                order[Case(m.size_bytes, m.op, m.mode)]))


ANCHORS: dict[Impl, tuple[Impl, ...]] = {
    ("kvpool", "tcp"): (("mooncake", "tcp"), ("raw-socket", "tcp")),
    ("kvpool", "shm"): (("memcpy", "shm"),),
    ("mooncake", "tcp"): (("raw-socket", "tcp"),),
}
"""What each implementation's `ratio` is relative to: the first of these measured."""


# -- output ------------------------------------------------------------------------------------

def _find(results: list[Measurement], impl: str, transport: str, size: int, op: str,
          mode: str) -> Measurement | None:
    for m in results:
        if (m.impl, m.transport, m.size_bytes, m.op, m.mode) == (impl, transport, size, op, mode):
            return m
    return None


def _rate(m: Measurement | None) -> str:
    if m is None:
        return f"{'-':>20}"
    return f"{m.gb_per_s:7.2f} GB/s {m.req_per_s:>9,.0f}/s"


def _x(a: Measurement | None, b: Measurement | None) -> str:
    return f"{a.gb_per_s / b.gb_per_s:6.2f}x" if a and b and b.gb_per_s else f"{'-':>7}"


def print_table(results: list[Measurement], rounds: int, seconds: float) -> None:
    print(f"kvpool transfer engine vs anchors: median of {rounds} alternating rounds, "
          f"{seconds:g} s per measurement; target in another process")
    kv = [m for m in results if m.impl == "kvpool"]
    for transport in ("tcp", "shm"):
        rows = [m for m in kv if m.transport == transport]
        if not rows:
            continue
        if transport == "tcp":
            print(f"\n{'size':>8} {'op':<5} {'mode':<7} | {'kvpool tcp':>20} | {'mooncake':>20} | "
                  f"{'raw socket':>20} | {'/mooncake':>9} {'/raw':>7}")
        else:
            print(f"\n{'size':>8} {'op':<5} {'mode':<7} | {'kvpool shm':>20} | {'memcpy':>20} | {'/memcpy':>7}")
        for m in rows:
            head = f"{format_size(m.size_bytes):>8} {m.op:<5} {m.mode:<7} | {_rate(m)} | "
            if transport == "tcp":
                moon = _find(results, "mooncake", "tcp", m.size_bytes, m.op, m.mode)
                raw = _find(results, "raw-socket", "tcp", m.size_bytes, m.op, m.mode)
                print(head + f"{_rate(moon)} | {_rate(raw)} | {_x(m, moon):>9} {_x(m, raw)}")
            else:
                copy = _find(results, "memcpy", "shm", m.size_bytes, m.op, m.mode)
                print(head + f"{_rate(copy)} | {_x(m, copy)}")


def goal_lines(results: list[Measurement]) -> list[str]:
    """The transfer-speed goals, judged on the medians of this run."""
    lines = []
    for op in OPS:
        m = _find(results, "kvpool", "tcp", 4 << 10, op, "single")
        moon = _find(results, "mooncake", "tcp", 4 << 10, op, "single")
        if m and moon:
            us, moon_us = 1e6 / m.req_per_s, 1e6 / moon.req_per_s
            lines.append(goal_line(us <= moon_us, f"tcp 4 KiB {op} round trip {us:.0f} us "
                                  f"<= mooncake {moon_us:.0f} us"))
    for size in (1 << 20, 8 << 20):
        for op in OPS:
            for mode in MODES:
                m = _find(results, "kvpool", "tcp", size, op, mode)
                moon = _find(results, "mooncake", "tcp", size, op, mode)
                raw = _find(results, "raw-socket", "tcp", size, op, mode)
                if m and moon and raw:
                    need = min(2 * moon.gb_per_s, 0.9 * raw.gb_per_s)
                    lines.append(goal_line(m.gb_per_s >= need, f"tcp {format_size(size)} {op} {mode} "
                                          f"{m.gb_per_s:.2f} GB/s >= min(2 x mooncake, 0.9 x raw) = {need:.2f}"))
                copy = _find(results, "memcpy", "shm", size, op, mode)
                shm = _find(results, "kvpool", "shm", size, op, mode)
                if shm and copy:
                    lines.append(goal_line(shm.gb_per_s >= 0.7 * copy.gb_per_s,
                                          f"shm {format_size(size)} {op} {mode} "
                                          f"{shm.gb_per_s / copy.gb_per_s:.2f} x memcpy >= 0.7"))
    return lines


