"""`kvpool bench mooncake-api`: the store (and transfer) benchmarks through Mooncake's Python
API, for kvpool (kvpool.compat over `kvpool master`) and for the real Mooncake wheel (over its
`mooncake_master`) in one run, with identical client code (kvpool.bench.mooncake_client).

Each implementation gets its own master (started with the same Mooncake flags), a memory node
process and a long-lived pure-client process (kvpool over tcp, and with `--shm` a second
kvpool client over shared memory). The run is `--rounds` rounds; in each, every client runs the
whole workload in turn, and so do the anchors (a raw loopback TCP socket to an echo process,
and memcpy), in an order that rotates from round to round, so load changes on the machine hit
all alike. Reported: the median of the rounds. Ratios are kvpool / Mooncake, kvpool / raw socket
and kvpool-shm / memcpy, each from the same run.

The per-round kvpool / Mooncake ratios are compared with a checked-in baseline
(kvpool.bench.mooncake_baseline): a case below its recorded band prints a REGRESSION line,
and `--fail-on-regression` makes that exit 3. `--record-baseline` adds the run to a baseline.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvpool.bench import anchors
from kvpool.bench import mooncake_baseline as baseline
from kvpool.bench.burners import burning
from kvpool.bench.common import Measurement, print_goals
from kvpool.bench.mooncake_goals import goal_lines
from kvpool.errors import ConfigError
from kvpool.launch.children import kvpool_argv, stop
from kvpool.launch.ports import free_port
from kvpool.launch.wait import wait_port
from kvpool.units import format_size, parse_size

_CLIENT = "kvpool.bench.mooncake_client"
MIN_SECONDS = 0.3
"""Default shortest measurement. A few calls are too short to time on a shared machine: with
--phase-bytes 8MiB a batched 64 KiB measurement was 4 calls, about 6 ms, and the medians of
its runs moved by a third from run to run; measured for 0.3 s, five runs' medians of the
batched 64 KiB put were 1.53-1.76x (docs/perf.md, fourteenth round)."""


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("mooncake-api", help="store and transfer through Mooncake's API: "
                              "kvpool vs the real Mooncake, alternating rounds")
    p.add_argument("--sizes", default="4KiB,64KiB", help="single-key object sizes")
    p.add_argument("--ops", type=int, default=400, help="single-key operations per measurement")
    p.add_argument("--batch-sizes", default="1MiB,4MiB", help="object sizes of batched calls")
    p.add_argument("--batch", type=int, default=16, help="keys per batched call")
    p.add_argument("--phase-bytes", default="64MiB", help="bytes put per batched measurement")
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds; medians reported")
    p.add_argument("--min-seconds", type=float, default=MIN_SECONDS,
                   help="each measurement lasts at least this long: reads and is_exist go "
                   "over their keys again, puts take new keys (up to a quarter of --dram); "
                   "0: --ops and --phase-bytes alone")
    p.add_argument("--dram", default="1GiB", help="memory of each store node")
    p.add_argument("--seconds", type=float, default=0.0,
                   help="time per TransferEngine measurement (0: skip the transfer phase)")
    p.add_argument("--shm", action="store_true", help="also a kvpool client over shm")
    p.add_argument("--impl", choices=("both", "kvpool", "mooncake"), default="both")
    p.add_argument("--load", type=int, default=0, metavar="N",
                   help="N processes spinning on the CPUs during the rounds (a loaded machine)")
    p.add_argument("--json", action="store_true", help="one JSON object per measurement")
    p.add_argument("--baseline", default=None, metavar="PATH",
                   help="ratios to compare with (default: the one shipped with kvpool; "
                   "'none': no comparison)")
    p.add_argument("--tolerance", type=float, default=baseline.DEFAULT_TOLERANCE,
                   help="how far (a fraction) a ratio may fall below its band's low end")
    p.add_argument("--fail-on-regression", action="store_true",
                   help="exit 3 when a ratio falls below its band (REGRESSION)")
    p.add_argument("--record-baseline", metavar="PATH",
                   help="add this run's ratios to PATH (created if missing)")
    p.add_argument("--handicap-us", type=float, default=0.0,
                   help="kvpool's clients spin this long before each timed call (to check "
                   "that the guard catches a slower client)")
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
    try:  # a bad baseline is refused before the rounds, not after them
        _baseline_files(args)
    except ConfigError as exc:
        print(f"kvpool bench mooncake-api: {exc}", file=sys.stderr)
        return 2
    impls = ["kvpool", "mooncake"] if args.impl == "both" else [args.impl]
    if "mooncake" in impls and mooncake_master_binary() is None:
        print("the real Mooncake wheel is not installed: kvpool only", file=sys.stderr)
        impls.remove("mooncake")
    if not impls:
        return 1
    single = [parse_size(s) for s in args.sizes.split(",") if s]
    batched = [parse_size(s) for s in args.batch_sizes.split(",") if s]
    if args.min_seconds < 0:
        print("kvpool bench mooncake-api: --min-seconds must be >= 0", file=sys.stderr)
        return 2
    command = {"single_sizes": single, "single_ops": args.ops, "batch_sizes": batched,
               "batch": args.batch, "phase_bytes": parse_size(args.phase_bytes),
               "transfer_s": args.seconds, "handicap_us": args.handicap_us,
               "min_s": args.min_seconds, "put_cap_bytes": parse_size(args.dram) // 4}
    load_start = os.getloadavg()[0]
    buffer_bytes = max([*batched, 0]) * args.batch + 2 * max([*single, 0]) + 4096
    rounds: list[list[Measurement]] = []
    with ExitStack() as stack:
        clients = _start(stack, impls, args.shm, parse_size(args.dram), buffer_bytes)
        raw = stack.enter_context(anchors.raw_socket())
        stack.enter_context(burning(args.load))
        for r in range(args.rounds):
            order = [*clients, "anchors"]
            shift = r % len(order)
            rounds.append([])
            for name in order[shift:] + order[:shift]:
                cmd = command | {"tag": f"r{r}"}
                rounds[-1] += _anchors(raw, cmd) if name == "anchors" else clients[name](cmd)
    results = medians([m for rows in rounds for m in rows])
    add_ratios(results)
    load = (load_start, os.getloadavg()[0])
    if args.json:
        for m in results:
            print(json.dumps(asdict(m)), flush=True)
    else:
        print_table(results, args.rounds)
        print_spread(round_ratios(rounds))
        print_goals(goal_lines(results))
        print(f"\nload average (1 min): {load[0]:.2f} at the start, {load[1]:.2f} at the end")
    return guard(args, baseline.run_figures(round_ratios(rounds), args.batch), load)


def settings(args: argparse.Namespace) -> list[str]:
    """The flags that decide what a run measures (recorded with a baseline)."""
    return ["--sizes", args.sizes, "--ops", str(args.ops), "--batch-sizes", args.batch_sizes,
            "--batch", str(args.batch), "--phase-bytes", args.phase_bytes,
            "--rounds", str(args.rounds), "--min-seconds", str(args.min_seconds),
            "--load", str(args.load)]


def _baseline_files(args: argparse.Namespace) -> tuple[dict[str, Any] | None,
                                                       dict[str, Any] | None]:
    """(the baseline to compare with, the one to record into), each None when not asked for
    or (recording) not there yet. ConfigError when either is unreadable or malformed, or the
    one to record into holds runs of other settings."""
    compared = None
    if args.baseline != "none":
        compared = baseline.load(Path(args.baseline) if args.baseline else
                                 baseline.default_path())
    known = None
    if args.record_baseline and Path(args.record_baseline).exists():
        known = baseline.load(Path(args.record_baseline))
        if known.get("command") != settings(args):
            raise ConfigError(f"{args.record_baseline} was recorded with "
                              f"{' '.join(known.get('command', []))}; a run with other "
                              "settings goes into another file")
    return compared, known


def guard(args: argparse.Namespace, figures: dict[baseline.Case, float],
          load: tuple[float, float]) -> int:
    """Compare the run with the baseline and record it; 3 on a regression with
    --fail-on-regression, else 0. Lines go to stdout, or stderr under --json."""
    out = sys.stderr if args.json else sys.stdout
    recorded, known = _baseline_files(args)
    if args.record_baseline:
        path = Path(args.record_baseline)
        path.write_text(json.dumps(baseline.add_run(known, figures, settings(args), load,
                                                    baseline.usable_cpus()), indent=1) + "\n")
        print(f"recorded in {path}", file=out)
    if recorded is None or not figures:
        return 0
    path = Path(args.baseline) if args.baseline else baseline.default_path()
    command = [str(x) for x in recorded.get("command", [])]
    print(f"\nagainst {path} (recorded with {' '.join(command)}):", file=out)
    their_load = command[command.index("--load") + 1] if "--load" in command[:-1] else "0"
    if their_load != str(args.load):
        print(f"not compared: recorded with --load {their_load}, this run --load {args.load}",
              file=out)
        return 0
    verdicts = baseline.compare(figures, recorded, args.tolerance, load,
                                baseline.usable_cpus())
    for line in baseline.report(verdicts, args.tolerance) or ["no case in common"]:
        print(line, file=out)
    regressed = any(v.regressed for v in verdicts)
    return 3 if regressed and args.fail_on_regression else 0


def _start(stack: ExitStack, impls: list[str], shm: bool, dram: int,
           buffer_bytes: int) -> dict[str, Any]:
    """Per client name, a function running one round on it."""
    clients = {}
    for impl in impls:
        master, _ = stack.enter_context(master_process(impl))
        stack.enter_context(node_process(impl, master, dram))
        clients[impl] = stack.enter_context(_client(impl, master, "tcp", buffer_bytes))
        if shm and impl == "kvpool":
            clients["kvpool-shm"] = stack.enter_context(
                _client(impl, master, "shm", buffer_bytes))
    return clients


def _anchors(raw: anchors.RawSocket, cmd: dict[str, Any]) -> list[Measurement]:
    out = []
    for size in cmd["single_sizes"]:
        gbps, reqs = raw.round_trips(size, cmd["single_ops"], cmd["min_s"])
        out.append(Measurement("mooncake-api-store", "raw-socket", "tcp", "round_trip",
                               "single", size, gbps, reqs))
    for size in cmd["batch_sizes"]:
        count = max(3, cmd["phase_bytes"] // (size * cmd["batch"]))
        gbps, reqs = raw.stream(size, cmd["batch"], count, cmd["min_s"])
        out.append(Measurement("mooncake-api-store", "raw-socket", "tcp", "stream", "batched",
                               size, gbps, reqs))
        gbps, reqs = anchors.memcpy(size, cmd["batch"], count, cmd["min_s"])
        out.append(Measurement("mooncake-api-store", "memcpy", "mem", "copy", "batched", size,
                               gbps, reqs))
    return out


def medians(rows: list[Measurement]) -> list[Measurement]:
    """One row per (bench, impl, transport, op, mode, size): the median of its rounds."""
    groups: dict[tuple[Any, ...], list[Measurement]] = {}
    for m in rows:
        groups.setdefault((m.bench, m.impl, m.transport, m.op, m.mode, m.size_bytes),
                          []).append(m)
    return [Measurement(bench, impl, transport, op, mode, size,
                        statistics.median(m.gb_per_s for m in ms),
                        statistics.median(m.req_per_s for m in ms))
            for (bench, impl, transport, op, mode, size), ms in groups.items()]


def add_ratios(results: list[Measurement]) -> None:
    """Set kvpool rows' ratio to kvpool / Mooncake (GB/s, or req/s where no bytes move)."""
    anchors_ = {(m.bench, m.op, m.mode, m.size_bytes): m for m in results
                if m.impl == "mooncake"}
    for m in results:
        anchor = anchors_.get((m.bench, m.op, m.mode, m.size_bytes))
        if not m.impl.startswith("kvpool") or anchor is None:
            continue
        mine, theirs = (m.gb_per_s, anchor.gb_per_s) if m.gb_per_s > 0 else \
            (m.req_per_s, anchor.req_per_s)
        if theirs > 0:
            m.anchor, m.ratio = "mooncake", mine / theirs


def round_ratios(rounds: list[list[Measurement]]) -> dict[tuple[str, str, int], list[float]]:
    """kvpool / Mooncake within each round, by (op, mode, size): the two were measured
    moments apart, so these ratios show how far the machine's noise moves the median's."""
    out: dict[tuple[str, str, int], list[float]] = {}
    for rows in rounds:
        by = {(m.impl, m.op, m.mode, m.size_bytes): m for m in rows
              if m.bench == "mooncake-api-store"}
        for (impl, op, mode, size), m in by.items():
            theirs = by.get(("mooncake", op, mode, size))
            if impl == "kvpool" and theirs is not None and _value(theirs, mode) > 0:
                out.setdefault((op, mode, size), []).append(
                    _value(m, mode) / _value(theirs, mode))
    return out


def print_spread(ratios: dict[tuple[str, str, int], list[float]]) -> None:
    """Per case, the lowest, median and highest kvpool / Mooncake ratio of the rounds."""
    if not ratios:
        return
    print("\nkv/mc within each round: lowest, median, highest")
    for (op, mode, size), values in ratios.items():
        print(f"{op:9} {mode:8} {format_size(size):>6} {min(values):6.2f} "
              f"{statistics.median(values):6.2f} {max(values):6.2f}")


def print_table(results: list[Measurement], rounds: int) -> None:
    """kvpool beside Mooncake and the anchors, with the ratios (medians of `rounds`)."""
    by = {(m.impl, m.op, m.mode, m.size_bytes): m for m in results
          if m.bench == "mooncake-api-store"}
    print(f"median of {rounds} alternating rounds; ops/s (GB/s for batched)")
    print(f"{'op':9} {'mode':8} {'size':>6} {'kvpool':>9} {'mooncake':>9} {'raw sock':>9} "
          f"{'memcpy':>8} {'kv/mc':>6} {'kv/raw':>6} {'shm':>9} {'shm/cpy':>7}")
    for (impl, op, mode, size), m in by.items():
        if impl != "kvpool":
            continue
        anchor = "round_trip" if mode == "single" else "stream"
        mc, raw = by.get(("mooncake", op, mode, size)), by.get(("raw-socket", anchor, mode, size))
        cpy, shm = by.get(("memcpy", "copy", mode, size)), by.get(("kvpool-shm", op, mode, size))
        if op == "is_exist":
            raw = cpy = None
        print(f"{op:9} {mode:8} {format_size(size):>6} {_v(m, mode)} {_v(mc, mode)} "
              f"{_v(raw, mode)} {_v(cpy, mode, 8)} {_r(m, mc, mode)} {_r(m, raw, mode)} "
              f"{_v(shm, mode)} {_r(shm, cpy, mode, 7)}")


def _value(m: Measurement, mode: str) -> float:
    return m.gb_per_s if mode == "batched" and m.gb_per_s > 0 else m.req_per_s


def _v(m: Measurement | None, mode: str, width: int = 9) -> str:
    if m is None:
        return " " * width
    return f"{_value(m, mode):{width}.2f}" if mode == "batched" and m.gb_per_s > 0 \
        else f"{m.req_per_s:{width},.0f}"


def _r(a: Measurement | None, b: Measurement | None, mode: str, width: int = 6) -> str:
    if a is None or b is None or _value(b, mode) <= 0:
        return " " * width
    return f"{_value(a, mode) / _value(b, mode):{width}.2f}"


@contextmanager
def master_process(impl: str) -> Iterator[tuple[str, int]]:
    """The implementation's master, started with the same Mooncake flags: (address, pid)."""
    rpc = free_port()
    flags = [f"--rpc_port={rpc}", f"--metrics_port={free_port()}",
             "--enable_http_metadata_server=false", "--default_kv_lease_ttl=200"]
    binary = mooncake_master_binary()
    command = [str(binary), *flags] if impl == "mooncake" and binary else \
        kvpool_argv("master", *flags)
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_port(rpc)
        yield f"127.0.0.1:{rpc}", proc.pid
    finally:
        stop(proc, 5.0)


@contextmanager
def node_process(impl: str, master: str, dram: int) -> Iterator[int]:
    """A process giving `dram` bytes to the implementation's pool: its pid."""
    with _child([_CLIENT, "node", impl, master, str(dram)], f"{impl} store node") as proc:
        yield proc.pid


@contextmanager
def _client(impl: str, master: str, protocol: str, buffer_bytes: int) -> Iterator[Any]:
    args = [_CLIENT, "serve", impl, master, protocol, str(buffer_bytes)]
    with _child(args, f"{impl} client") as proc:
        def one_round(command: dict[str, Any]) -> list[Measurement]:
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.write(json.dumps(command) + "\n")
            proc.stdin.flush()
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"{impl} ({protocol}) client died during a round")
            rows = [Measurement(**row) for row in json.loads(line)]
            if protocol != "tcp":  # kvpool-shm: a name of its own beside kvpool over tcp
                for m in rows:
                    m.impl = f"{impl}-{protocol}"
            return rows
        yield one_round


@contextmanager
def _child(args: list[str], what: str) -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen([sys.executable, "-m", *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True,
                            stderr=None if os.environ.get("KVPOOL_BENCH_STDERR") else
                            subprocess.DEVNULL)
    try:
        assert proc.stdout is not None
        announced = json.loads(proc.stdout.readline() or "{}")
        if not announced.get("ready"):
            raise RuntimeError(f"{what} did not start: {announced}")
        yield proc
    finally:
        if proc.stdin:
            proc.stdin.close()
        stop(proc, 10)
