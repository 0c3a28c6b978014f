"""`kvpool bench proxy-vllm`: what kvpool's proxy costs in front of a vLLM server, beside the
client asking the server straight, in one run.

    client (closed loop, kept-alive) --> kvpool proxy --backend vllm --> emulated worker
                                     -----------------------------------/ behind vLLM's API
                                                                          (`--api vllm`)

Both ways the client sends the same streamed `/v1/completions` (the prompt as token ids, as
the proxy's vllm backend sends it on), so the two differ by the proxy alone: its conductor's
decision, its relay of vLLM's SSE, its polls of the server's `/metrics`. The server is
kvpool's emulated engine behind vLLM's face (`--speed-up`: its steps cost almost nothing); a
real vLLM's own per-request cost is not what is measured here. Rounds alternate between the
two ways (and their order each round); the loads, CPU figures and rows are `kvpool bench
proxy`'s, and each `kvpool-vllm` row gets `ratio_*` over the `vllm-direct` row of its load.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from kvpool.bench.proxy import DEFAULT_LOADS, HOST, Relay, int_list, measure
from kvpool.bench.proxy_rows import fmt, worker_text
from kvpool.errors import KvpoolError

SERVED = "emu"
PROMPT_IDS = [16 + (i * 7919) % 496 for i in range(40)]


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("proxy-vllm", help="the proxy's CPU per request and per token in "
                              "front of a vLLM server (its emulated face), beside the client "
                              "asking the server straight")
    p.add_argument("--rounds", type=int, default=3, help="rounds per way, alternating")
    p.add_argument("--streams", type=int, default=32, help="256-token streams per way per round")
    p.add_argument("--requests", type=int, default=128,
                   help="16-token requests per way per round")
    p.add_argument("--concurrency", type=int_list, default=[8], metavar="C[,C...]",
                   help="kept-alive connections; a list runs each (e.g. 1,8,32)")
    p.add_argument("--speed-up", type=float, default=1000.0,
                   help="the emulated engine's speed-up over its profile")
    p.add_argument("--json", action="store_true", help="one JSON object per row")
    p.set_defaults(func=_main, stream_interval=1, loads=DEFAULT_LOADS.split(","), engines=1)


def _main(args: argparse.Namespace) -> int:
    try:
        with tempfile.TemporaryDirectory(prefix="kvpool-bench-proxy-vllm-") as tmp, \
                ways(Path(tmp), args.speed_up) as (relays_up, worker_pid):
            rows = with_direct_ratios(measure(relays_up, [worker_pid], args))
    except (ValueError, KvpoolError, OSError) as exc:
        print(f"kvpool bench proxy-vllm: {exc}", flush=True)
        return 1
    for row in rows:
        print(json.dumps(row) if args.json else _fmt(row), flush=True)
    return 0


@contextmanager
def ways(tmp: Path, speed_up: float) -> Iterator[tuple[list[Relay], int]]:
    """The emulated worker behind vLLM's face, the proxy in front of it; the two ways to it
    and the worker's pid; all stopped on exit."""
    from kvpool.bench.proxy_cluster import start_proxy, start_worker

    with ExitStack() as stack:
        worker, port = start_worker(stack, tmp, speed_up, "--api", "vllm",
                                    "--served-model-name", SERVED)
        proxy, proxy_port, model = start_proxy(
            stack, tmp, worker, port, speed_up,
            flags=("--backend", "vllm", "--colocated", f"http://{HOST}:{port}"),
            named=False)
        yield [Relay("kvpool-vllm", proxy_port, [proxy.pid], _completion(model), _whole,
                     f"http://{HOST}:{proxy_port}"),
               Relay("vllm-direct", port, [worker.pid], _completion(SERVED), _whole)], worker.pid


def _completion(model: str) -> Callable[[int, int, bool], tuple[str, bytes]]:
    def make(i: int, max_tokens: int, stream: bool = True) -> tuple[str, bytes]:
        body = {"model": model, "prompt": PROMPT_IDS, "max_tokens": max_tokens, "stream": True,
                "ignore_eos": True, "temperature": 0}
        return "/v1/completions", json.dumps(body).encode()
    return make


def _whole(body: bytes, max_tokens: int, stream: bool = True) -> int:
    """A stream that ends in `[DONE]` after a finish reason of length: with ignore_eos that
    is max_tokens tokens (both vLLM's and the proxy's chunks; their spacing differs)."""
    if not body.endswith(b"data: [DONE]\n\n") or b'"length"' not in body:
        raise ValueError(f"the stream is not whole: ...{body[-300:]!r}")
    return max_tokens


def with_direct_ratios(out: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The proxy's rows get `ratio_*` over the direct row of the same load; its added CPU
    (the proxy's own) per request and per token is its relay CPU, the direct way's none."""
    direct = {r["load"]: r for r in out if r["relay"] == "vllm-direct"}
    for r in out:
        r["bench"] = "proxy-vllm"
        d = direct.get(r["load"])
        if r["relay"] != "kvpool-vllm" or d is None:
            continue
        r["ratio_req_per_s"] = round(r["req_per_s"] / d["req_per_s"], 2) if d["req_per_s"] \
            else None
    return out


def _fmt(row: dict[str, Any]) -> str:
    line = fmt(row)
    if row["relay"] == "vllm-direct":  # no relay: the worker's own CPU is in the brackets
        line = line.split("  relay CPU")[0] + "  (straight to the server)" + worker_text(row)
    elif row.get("ratio_req_per_s"):
        line += f"  x{row['ratio_req_per_s']:.2f} req/s of straight"
    return line
