"""`kvpool bench proxy`: what kvpool's proxy costs to relay a stream, beside nginx relaying the
same worker's stream, in one run.

    client (closed loop, kept-alive) --> kvpool proxy --> emulated colocated worker
                                     --> nginx -------/   (--speed-up 1000: its steps cost
                                                           almost nothing)

Through the proxy the client asks `/v1/completions` (streamed SSE); through nginx it asks the
worker's own `/generate` (its NDJSON lines) for the same prompt's tokens, so both relay the
same number of tokens from the same worker. Rounds alternate between the two (and their order
each round), so a machine that drifts drifts for both. Two loads: streams of 256 tokens (the
CPU per relayed token) and requests of 16 tokens (the CPU per request). The CPU is the relay
processes' user + system time from /proc (the proxy; nginx's master and worker), also the
worker's, over the wall time of the load; the ratio is kvpool's over nginx's.

Without nginx installed the bench says so and prints kvpool's figures alone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import tempfile
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from kvpool.bench.http_load import Load, drive
from kvpool.bench.nginx import INSTALL_HINT, find_nginx, running_nginx
from kvpool.bench.proc_cpu import CpuMeter, child_pids, per_unit
from kvpool.errors import KvpoolError
from kvpool.launch.wait import wait_for

HOST = "127.0.0.1"
PROMPT = "the pool keeps every block of the cache " * 4
LOADS = (("stream256", 256), ("req16", 16))
"""(name, output tokens per request)."""


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("proxy", help="the proxy's CPU per relayed token and per request, "
                              "beside nginx relaying the same worker")
    p.add_argument("--rounds", type=int, default=3, help="rounds per relay, alternating")
    p.add_argument("--streams", type=int, default=48,
                   help="256-token streams per relay per round")
    p.add_argument("--requests", type=int, default=256,
                   help="16-token requests per relay per round")
    p.add_argument("--concurrency", type=int, default=8, help="kept-alive connections")
    p.add_argument("--speed-up", type=float, default=1000.0,
                   help="the emulated worker's speed-up over its profile")
    p.add_argument("--stream-interval", type=int, default=1, metavar="N",
                   help="the worker's frames: one every N output tokens after the first (for "
                   "both relays: nginx relays the same frames)")
    p.add_argument("--worker-sse", action="store_true",
                   help="also a proxy that relays the SSE text chunks the worker makes "
                   "(kvpool proxy --worker-sse), in the same rounds: relay kvpool-wsse")
    p.add_argument("--proxy-processes", type=int, default=1, metavar="N",
                   help="also a proxy of N processes (kvpool proxy --workers N), in the same "
                   "rounds: relay kvpool-pN")
    p.add_argument("--no-nginx", action="store_true", help="kvpool's proxy alone")
    p.add_argument("--baseline-src", type=Path, default=None, metavar="DIR",
                   help="also a proxy run from another kvpool's sources (DIR holds its kvpool "
                   "package), in the same rounds: relay kvpool-base")
    p.add_argument("--json", action="store_true", help="one JSON object per row")
    p.set_defaults(func=_main)


@dataclass
class Relay:
    """One way to the worker: its name, port, path, the pids that do the relaying, and how a
    request is made and its reply checked."""

    name: str
    port: int
    pids: list[int]
    make: Callable[[int, int], tuple[str, bytes]]
    """(request number, max_tokens) -> (path, body)."""
    check: Callable[[bytes, int], int]
    """(body, max_tokens) -> output tokens; ValueError when the reply is not whole."""


@dataclass
class Tally:
    requests: int = 0
    tokens: int = 0
    wall_s: float = 0.0
    relay_cpu_s: float = 0.0
    worker_cpu_s: float = 0.0

    def add(self, load: Load, relay_cpu_s: float, worker_cpu_s: float) -> None:
        self.requests += load.requests
        self.tokens += load.units
        self.wall_s += load.wall_s
        self.relay_cpu_s += relay_cpu_s
        self.worker_cpu_s += worker_cpu_s


def _main(args: argparse.Namespace) -> int:
    exe = None if args.no_nginx else find_nginx()
    if exe is None and not args.no_nginx:
        print(f"nginx is not installed ({INSTALL_HINT}): kvpool's figures alone", flush=True)
    try:
        with tempfile.TemporaryDirectory(prefix="kvpool-bench-proxy-") as tmp, \
                relays(Path(tmp), args.speed_up, exe, args.baseline_src,
                       args.stream_interval, args.worker_sse,
                       args.proxy_processes) as (relays_up, worker_pid):
            rows = measure(relays_up, worker_pid, args)
    except (ValueError, KvpoolError, OSError) as exc:
        print(f"kvpool bench proxy: {exc}", flush=True)
        return 1
    for row in rows:
        print(json.dumps(row) if args.json else fmt(row), flush=True)
    return 0


def measure(relays_up: list[Relay], worker_pid: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    tallies = {(r.name, load): Tally() for r in relays_up for load, _ in LOADS}
    counts = {"stream256": args.streams, "req16": args.requests}
    for r in relays_up:  # warm up: connections, the worker's prefix cache, the proxy's code
        _run(r, args.concurrency, args.concurrency, 16, worker_pid)
    for i in range(args.rounds):
        order = relays_up if i % 2 == 0 else relays_up[::-1]
        for load, max_tokens in LOADS:
            for r in order:
                tallies[r.name, load].add(*_run(r, counts[load], args.concurrency, max_tokens,
                                                worker_pid))
    return rows(tallies, args)


def _run(r: Relay, num: int, concurrency: int, max_tokens: int,
         worker_pid: int) -> tuple[Load, float, float]:
    relay, worker = CpuMeter(r.pids), CpuMeter([worker_pid])
    relay.start()
    worker.start()
    load = asyncio.run(drive(HOST, r.port, lambda i: r.make(i, max_tokens),
                             lambda body: r.check(body, max_tokens), num, concurrency))
    return load, relay.seconds(), worker.seconds()


def rows(tallies: dict[tuple[str, str], Tally], args: argparse.Namespace) -> list[dict[str, Any]]:
    out = []
    for (name, load), t in tallies.items():
        row = {"bench": "proxy", "relay": name, "load": load, "concurrency": args.concurrency,
               "speed_up": args.speed_up, "stream_interval": args.stream_interval,
               "requests": t.requests, "tokens": t.tokens,
               "wall_s": round(t.wall_s, 3),
               "req_per_s": round(t.requests / t.wall_s, 1) if t.wall_s else 0.0,
               "tokens_per_s": round(t.tokens / t.wall_s, 1) if t.wall_s else 0.0,
               "relay_cpu_s": round(t.relay_cpu_s, 3),
               "relay_us_per_token": round(per_unit(t.relay_cpu_s, t.tokens, 1e6), 1),
               "relay_ms_per_request": round(per_unit(t.relay_cpu_s, t.requests, 1e3), 3),
               "worker_us_per_token": round(per_unit(t.worker_cpu_s, t.tokens, 1e6), 1)}
        out.append(row)
    return with_ratios(out)


def with_ratios(out: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """kvpool's rows (kvpool-base's too) get `ratio_*`: their figure over nginx's on the same
    load (None without nginx)."""
    nginx = {r["load"]: r for r in out if r["relay"] == "nginx"}
    for r in out:
        if not r["relay"].startswith("kvpool"):
            continue
        n = nginx.get(r["load"])
        for key in ("relay_us_per_token", "relay_ms_per_request", "req_per_s"):
            r[f"ratio_{key}"] = round(r[key] / n[key], 2) if n and n[key] else None
    return out


def fmt(row: dict[str, Any]) -> str:
    ratio = row.get("ratio_relay_us_per_token")
    vs = (f"  x{ratio:.1f} nginx per token, x{row['ratio_relay_ms_per_request']:.1f} per "
          f"request, x{row['ratio_req_per_s']:.2f} req/s" if ratio else "")
    return (f"{row['relay']:<11} {row['load']:<10} c={row['concurrency']:<3} "
            f"{row['req_per_s']:8.1f} req/s {row['tokens_per_s']:9.0f} tok/s  relay CPU "
            f"{row['relay_us_per_token']:7.1f} us/token {row['relay_ms_per_request']:7.3f} "
            f"ms/request  (worker {row['worker_us_per_token']:.1f} us/token){vs}")


@contextmanager
def relays(tmp: Path, speed_up: float, nginx_exe: str | None,
           baseline_src: Path | None = None,
           stream_interval: int = 1,
           worker_sse: bool = False,
           processes: int = 1) -> Iterator[tuple[list[Relay], int]]:
    """The emulated worker, the proxy in front of it, nginx (with `nginx_exe`) and a proxy
    from `baseline_src` (if given): the relays and the worker's pid; all stopped on exit."""
    from kvpool.bench.proxy_cluster import start_proxy, start_worker

    with ExitStack() as stack:
        worker, worker_port = start_worker(stack, tmp, speed_up,
                                           "--stream-interval", str(stream_interval))
        proxy, proxy_port, model = start_proxy(stack, tmp, worker, worker_port, speed_up)
        prompt_ids = httpx.post(f"http://{HOST}:{proxy_port}/tokenize",
                                json={"prompt": PROMPT}, timeout=30).json()["tokens"]
        out = [Relay("kvpool", proxy_port, [proxy.pid], _completion(model), _sse_tokens)]
        if worker_sse:
            wsse, wsse_port, _ = start_proxy(stack, tmp, worker, worker_port, speed_up,
                                             flags=("--worker-sse",))
            out.append(Relay("kvpool-wsse", wsse_port, [wsse.pid], _completion(model),
                             _sse_tokens))
        if processes > 1:  # the group's processes are the children of the one started
            group, group_port, _ = start_proxy(stack, tmp, worker, worker_port, speed_up,
                                               flags=("--workers", str(processes)))
            wait_for(lambda: len(child_pids(group.pid)) == processes, 30, "the group")
            out.append(Relay(f"kvpool-p{processes}", group_port, child_pids(group.pid),
                             _completion(model), _sse_tokens))
        if baseline_src is not None:
            base, base_port, _ = start_proxy(stack, tmp, worker, worker_port, speed_up,
                                             baseline_src)
            out.append(Relay("kvpool-base", base_port, [base.pid], _completion(model),
                             _sse_tokens))
        if nginx_exe is not None:
            ng = stack.enter_context(running_nginx(nginx_exe, tmp / "nginx", worker_port, HOST))
            out.append(Relay("nginx", ng.port, ng.pids, _generate(prompt_ids), _ndjson_tokens))
        yield out, worker.pid


def _completion(model: str) -> Callable[[int, int], tuple[str, bytes]]:
    def make(i: int, max_tokens: int) -> tuple[str, bytes]:
        body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "stream": True,
                "ignore_eos": True, "temperature": 0}
        return "/v1/completions", json.dumps(body).encode()
    return make


def _generate(prompt_ids: list[int]) -> Callable[[int, int], tuple[str, bytes]]:
    pid = os.getpid()

    def make(i: int, max_tokens: int) -> tuple[str, bytes]:
        body = {"request_id": f"bench-{pid}-{max_tokens}-{i}", "prompt_token_ids": prompt_ids,
                "sampling": {"max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}}
        return "/generate", json.dumps(body).encode()
    return make


def _sse_tokens(body: bytes, max_tokens: int) -> int:
    """A whole stream ends in `[DONE]` after a chunk whose finish_reason is length: with
    ignore_eos that is max_tokens tokens."""
    if not body.endswith(b"data: [DONE]\n\n") or b'"finish_reason":"length"' not in body:
        raise ValueError(f"the proxy's stream is not whole: ...{body[-300:]!r}")
    return max_tokens


def _ndjson_tokens(body: bytes, max_tokens: int) -> int:
    """The tokens of the frames (and of one-token lines), which must be max_tokens, followed
    by the finish line. Counted with a regular expression, not a JSON parse per line: the
    client shares the machine with the relays it measures."""
    frames = _FRAME_IDS.findall(body)
    tokens = sum(ids.count(b",") + 1 for ids in frames) + body.count(b'"type":"token"')
    last = json.loads(body.rstrip().rsplit(b"\n", 1)[-1] or b"{}")
    if last.get("type") != "finish" or tokens != max_tokens:
        raise ValueError(f"the worker's stream is not whole ({tokens} tokens): "
                         f"...{body[-300:]!r}")
    return tokens


_FRAME_IDS = re.compile(rb'"token_ids":\[([0-9,]+)\]')
