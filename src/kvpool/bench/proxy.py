"""`kvpool bench proxy`: what kvpool's proxy costs to relay a stream, beside nginx relaying the
same worker's stream and the client asking the worker straight, in one run.

    client (closed loop, kept-alive) --> kvpool proxy --> emulated colocated worker(s)
                                     --> nginx -------/   (--speed-up 1000: their steps cost
                                     --> direct ------/    almost nothing)

Through the proxy the client asks `/v1/completions` (SSE, or one JSON body for the `json*`
loads); through nginx and straight it asks the worker's own `/generate` (its NDJSON lines) for
the same prompt's tokens, so every way carries the same number of tokens from the same worker
in the same frames (the steps the worker's loop fell behind as one, `merge_steps`, as the proxy
asks by default).
Rounds alternate between the ways (and their order each round), so a machine that drifts
drifts for all. Loads: streams of 256 tokens (the CPU per relayed token), requests of 16
tokens (the CPU per request), each at every `--concurrency`. The CPU is the relay processes'
user + system time from /proc (the proxy; nginx's master and worker), also the workers', over
the wall time of the load; latency is each request's send to its reply's end, and `added` is a
relay's over the direct way's; the conductor's decision time comes from the proxy's
kvpool_proxy_decision_seconds histogram, read before and after each run. `--engines N` puts N
workers behind the relays (the proxy schedules among them, nginx takes turns; the direct way
asks the first), for the scheduling cost per request at scale.

With `--py-relay` two relays in Python on uvloop stand in front of the worker too, relaying
what nginx relays: a bare byte relay (kvpool.bench.loop_relay, row py-relay) and the least HTTP
relay (kvpool.bench.http_relay, row py-http: each request and reply parsed, bodies re-chunked,
as nginx does). They are the floors of a relay written in Python, with and without reading
HTTP, so that what the proxy spends above them is seen to be its own work.

Without nginx installed the bench says so and prints kvpool's figures (and direct's) alone.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
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

from kvpool.bench.common import print_goals
from kvpool.bench.http_load import Load, drive
from kvpool.bench.http_relay import running_http_relay
from kvpool.bench.loop_relay import running_loop_relay
from kvpool.bench.nginx import INSTALL_HINT, find_nginx, running_nginx
from kvpool.bench.proc_cpu import CpuMeter, ThreadShareMeter, WriteMeter, child_pids
from kvpool.bench.proxy_goals import goal_lines
from kvpool.bench.proxy_rows import (
    CHUNKS_METRIC,
    DECISION_METRIC,
    DIRECT,
    GC_METRIC,
    RELAYED_METRIC,
    Scrape,
    Tally,
    fmt,
    rows,
)
from kvpool.engine.worker.loop import ENGINE_THREAD
from kvpool.errors import KvpoolError
from kvpool.launch.wait import wait_for

HOST = "127.0.0.1"
PROMPT = "the pool keeps every block of the cache " * 4
LOADS = {"stream256": (256, True), "req16": (16, True), "json16": (16, False),
         "json256": (256, False)}
"""name -> (output tokens per request, streamed)."""
DEFAULT_LOADS = "stream256,req16"
PY_RELAY = "py-relay"
"""The bare Python relay's row (`--py-relay`)."""
PY_HTTP = "py-http"
"""The least HTTP relay's row (`--py-relay`)."""


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("proxy", help="the proxy's CPU per relayed token and per request, "
                              "beside nginx relaying the same worker")
    p.add_argument("--rounds", type=int, default=3, help="rounds per relay, alternating")
    p.add_argument("--streams", type=int, default=48,
                   help="256-token streams per relay per round")
    p.add_argument("--requests", type=int, default=256,
                   help="16-token requests per relay per round")
    p.add_argument("--concurrency", type=int_list, default=[8], metavar="C[,C...]",
                   help="kept-alive connections; a list runs each (e.g. 1,8,32)")
    p.add_argument("--loads", type=_loads, default=_loads(DEFAULT_LOADS), metavar="NAME[,...]",
                   help=f"of {', '.join(LOADS)} (json*: one JSON body, not a stream; default "
                   f"{DEFAULT_LOADS})")
    p.add_argument("--engines", type=int, default=1, metavar="N",
                   help="emulated workers behind the relays (the proxy schedules among them)")
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
    p.add_argument("--py-relay", action="store_true",
                   help="also two relays in Python on uvloop in front of the worker, the floors "
                   "of any relay written in Python: a bare byte relay (kvpool.bench.loop_relay: "
                   "no parsing, a write per read; relay py-relay) and the least HTTP relay "
                   "(kvpool.bench.http_relay: requests and replies parsed, bodies re-chunked, "
                   "as nginx does; relay py-http)")
    p.add_argument("--no-nginx", action="store_true", help="without nginx's rows")
    p.add_argument("--baseline-src", type=Path, default=None, metavar="DIR",
                   help="also a proxy run from another kvpool's sources (DIR holds its kvpool "
                   "package), in the same rounds: relay kvpool-base")
    p.add_argument("--json", action="store_true", help="one JSON object per row")
    p.set_defaults(func=_main)


def int_list(text: str) -> list[int]:
    """Comma-separated integers of at least 1 (an argparse type)."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"need integers of at least 1: {text!r}")
    return values


def _loads(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [n for n in names if n not in LOADS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown load(s) {unknown or text!r}; of {list(LOADS)}")
    return names


@dataclass
class Relay:
    """One way to the worker: its name, port, path, the pids that do the relaying (none for
    the direct way), how a request is made and its reply checked, and where its decision
    times are read (a single proxy process's base URL; None elsewhere)."""

    name: str
    port: int
    pids: list[int]
    make: Callable[[int, int, bool], tuple[str, bytes]]
    """(request number, max_tokens, streamed) -> (path, body)."""
    check: Callable[[bytes, int, bool], int]
    """(body, max_tokens, streamed) -> output tokens; ValueError when the reply is not whole."""
    metrics_url: str | None = None


def _main(args: argparse.Namespace) -> int:
    exe = None if args.no_nginx else find_nginx()
    if exe is None and not args.no_nginx:
        print(f"nginx is not installed ({INSTALL_HINT}): kvpool's figures alone", flush=True)
    try:
        with tempfile.TemporaryDirectory(prefix="kvpool-bench-proxy-") as tmp, \
                relays(Path(tmp), args.speed_up, exe, args.baseline_src,
                       args.stream_interval, args.worker_sse,
                       args.proxy_processes, args.engines,
                       args.py_relay) as (relays_up, worker_pids):
            found = measure(relays_up, worker_pids, args)
    except (ValueError, KvpoolError, OSError) as exc:
        print(f"kvpool bench proxy: {exc}", flush=True)
        return 1
    for row in found:
        print(json.dumps(row) if args.json else fmt(row), flush=True)
    if not args.json:
        print_goals(goal_lines(found), "each relay's totals over the rounds of this run")
    return 0


def measure(relays_up: list[Relay], worker_pids: list[int],
            args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every relay, load and concurrency, `args.rounds` times, alternating: the rows."""
    loads, levels = args.loads, args.concurrency
    tallies = {(r.name, load, c): Tally() for load in loads for c in levels for r in relays_up}
    for r in relays_up:  # warm up: connections, the worker's prefix cache, the proxy's code
        _run(r, max(levels), max(levels), 16, True, worker_pids)
    for i in range(args.rounds):
        order = relays_up if i % 2 == 0 else relays_up[::-1]
        for load in loads:
            max_tokens, stream = LOADS[load]
            num = args.streams if max_tokens > 16 else args.requests
            for c in levels:
                for r in order:
                    tallies[r.name, load, c].add(*_run(r, num, c, max_tokens, stream,
                                                       worker_pids))
    return rows(tallies, {"speed_up": args.speed_up, "stream_interval": args.stream_interval,
                          "engines": args.engines})


def _run(r: Relay, num: int, concurrency: int, max_tokens: int, stream: bool,
         worker_pids: list[int]) -> tuple[Load, float, float, Scrape | None, float, int]:
    """(the load's figures, the relay's CPU, the workers', what the proxy's /metrics counted
    meanwhile, the workers' engine threads', the relay's write calls)."""
    before = _scrape(r.metrics_url)
    relay, writes = (CpuMeter(r.pids), WriteMeter(r.pids)) if r.pids else (None, None)
    worker = ThreadShareMeter(worker_pids, ENGINE_THREAD)
    if relay and writes:
        relay.start()
        writes.start()
    worker.start()
    load = asyncio.run(drive(HOST, r.port, lambda i: r.make(i, max_tokens, stream),
                             lambda body: r.check(body, max_tokens, stream), num, concurrency))
    relay_s, (worker_s, engine_s) = relay.seconds() if relay else 0.0, worker.seconds()
    written = writes.calls() if writes else 0
    after = _scrape(r.metrics_url)
    return load, relay_s, worker_s, \
        before.delta(after) if before is not None and after is not None else None, \
        engine_s, written


def _scrape(url: str | None) -> Scrape | None:
    """The proxy's decision histogram (cumulative count by `le`) and its stream chunk counts
    now, or None."""
    if url is None:
        return None
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=30).text
    out = Scrape({})
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == DECISION_METRIC + "_bucket":
                out.decisions[float(s.labels["le"])] = s.value
            elif s.name == CHUNKS_METRIC:
                out.chunks = s.value
            elif s.name == RELAYED_METRIC:
                out.relayed = s.value
            elif s.name == GC_METRIC:
                out.gc_s = (out.gc_s or 0.0) + s.value
    return out


@contextmanager
def relays(tmp: Path, speed_up: float, nginx_exe: str | None,
           baseline_src: Path | None = None,
           stream_interval: int = 1,
           worker_sse: bool = False,
           processes: int = 1,
           engines: int = 1,
           py_relay: bool = False) -> Iterator[tuple[list[Relay], list[int]]]:
    """`engines` emulated workers, the proxy in front of them, nginx (with `nginx_exe`), the
    direct way (to the first worker) and a proxy from `baseline_src` (if given): the relays
    and the workers' pids; all stopped on exit."""
    from kvpool.bench.proxy_cluster import start_proxy, start_workers

    with ExitStack() as stack:
        workers = start_workers(stack, tmp, speed_up, engines,
                                "--stream-interval", str(stream_interval))
        worker, worker_port = workers[0]
        behind = tuple(f for _, port in workers for f in ("--prefill", f"http://{HOST}:{port}"))

        def proxy(name: str, flags: tuple[str, ...] = (), src: Path | None = None,
                  decisions: bool = True) -> Relay:
            """`decisions`: its decision histogram is read (one process, these sources)."""
            proc, port, model = start_proxy(stack, tmp, worker, worker_port, speed_up, src,
                                            flags=(*behind, *flags), named=False)
            return Relay(name, port, [proc.pid], _completion(model), _completion_tokens,
                         f"http://{HOST}:{port}" if decisions else None)

        out = [proxy("kvpool")]
        prompt_ids = httpx.post(f"http://{HOST}:{out[0].port}/tokenize",
                                json={"prompt": PROMPT}, timeout=30).json()["tokens"]
        if worker_sse:
            out.append(proxy("kvpool-wsse", ("--worker-sse",)))
        if processes > 1:  # the group's processes are the children of the one started
            group = proxy(f"kvpool-p{processes}", ("--workers", str(processes)),
                          decisions=False)  # a scrape sees one of its processes
            wait_for(lambda: len(child_pids(group.pids[0])) == processes, 30, "the group")
            group.pids = child_pids(group.pids[0])
            out.append(group)
        if baseline_src is not None:  # its histogram's buckets may differ
            out.append(proxy("kvpool-base", src=baseline_src, decisions=False))
        if nginx_exe is not None:
            ng = stack.enter_context(running_nginx(nginx_exe, tmp / "nginx",
                                                   [port for _, port in workers], HOST))
            out.append(Relay("nginx", ng.port, ng.pids, _generate(prompt_ids), _ndjson_tokens))
        if py_relay:
            for name, running in ((PY_RELAY, running_loop_relay), (PY_HTTP, running_http_relay)):
                port, pid = stack.enter_context(running(worker_port))
                out.append(Relay(name, port, [pid], _generate(prompt_ids), _ndjson_tokens))
        out.append(Relay(DIRECT, worker_port, [], _generate(prompt_ids), _ndjson_tokens))
        yield out, [w.pid for w, _ in workers]


def _completion(model: str) -> Callable[[int, int, bool], tuple[str, bytes]]:
    """Each request's prompt ends apart (a number no other request of the run has), so the
    proxy tokenizes every one whole, as it would users' prompts: its tokenizer remembers the
    prompts it has seen (serve/token_cache.py)."""
    numbers = itertools.count()

    def make(i: int, max_tokens: int, stream: bool) -> tuple[str, bytes]:
        body = {"model": model, "prompt": f"{PROMPT}{next(numbers)}", "max_tokens": max_tokens,
                "stream": stream, "ignore_eos": True, "temperature": 0}
        return "/v1/completions", json.dumps(body).encode()
    return make


def _generate(prompt_ids: list[int]) -> Callable[[int, int, bool], tuple[str, bytes]]:
    """The worker's own stream, whatever the client's request streams (the worker has no
    other reply)."""
    pid = os.getpid()

    def make(i: int, max_tokens: int, stream: bool) -> tuple[str, bytes]:
        body = {"request_id": f"bench-{pid}-{max_tokens}-{int(stream)}-{i}",
                "prompt_token_ids": prompt_ids,
                "sampling": {"max_tokens": max_tokens, "ignore_eos": True, "temperature": 0},
                "merge_steps": True}  # the frames the proxy asks for by default
        return "/generate", json.dumps(body).encode()
    return make


def _completion_tokens(body: bytes, max_tokens: int, stream: bool) -> int:
    return _sse_tokens(body, max_tokens) if stream else _json_tokens(body, max_tokens)


def _sse_tokens(body: bytes, max_tokens: int) -> int:
    """A whole stream ends in `[DONE]` after a chunk whose finish_reason is length: with
    ignore_eos that is max_tokens tokens."""
    if not body.endswith(b"data: [DONE]\n\n") or b'"finish_reason":"length"' not in body:
        raise ValueError(f"the proxy's stream is not whole: ...{body[-300:]!r}")
    return max_tokens


def _json_tokens(body: bytes, max_tokens: int) -> int:
    """A whole completion: finish_reason length and usage.completion_tokens max_tokens."""
    try:
        reply = json.loads(body)
        done = reply["choices"][0]["finish_reason"], reply["usage"]["completion_tokens"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise ValueError(f"the proxy's completion is not whole: {body[:300]!r}") from None
    if done != ("length", max_tokens):
        raise ValueError(f"the proxy's completion is not whole: {done}")
    return max_tokens


def _ndjson_tokens(body: bytes, max_tokens: int, stream: bool = True) -> int:
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
