"""`kvpool bench attacks`: a victim's latency through the proxy alone, then while one client
sends the worst the serving surface allows (docs/serve.md, "Security and isolation").

One real cluster (master, store node, a prefill and a decode worker, the proxy) on the tiny
model. The victim is a greedy 32-token completion of a short prompt; its median latency under
each attack is printed beside its median alone, measured in the same run (`vs_solo`). The
attacks:

- `largest body`: two clients in a loop, each a prompt of just under --max-body-bytes
  (tokenized off the event loop, then refused for the context: a 400);
- `oversized body`: two clients in a loop, 12 MB bodies (a 413 from Content-Length);
- `one plain stream`: a 256-token stream beside the victim (what sharing the decode batch
  costs it, the baseline of the next row);
- `stop strings at the cap`: the same stream with 16 stop strings of 512 characters;
- `silent connections`: 600 connections that send nothing (the proxy's cap is 256 here);
- `trickled heads`: 200 connections sending one byte of a request head per second.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

VICTIM_RUNS = 7
MAX_CONNECTIONS = 256


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("attacks", help="a victim's latency under each serving attack")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    from kvpool.launch.ports import free_port
    from kvpool.serve.launch import ServingSpec, ensure_tiny_model, serving_cluster

    with tempfile.TemporaryDirectory() as tmp:
        model = ensure_tiny_model(Path(tmp) / "tiny")
        spec = ServingSpec(model, port=free_port(), dram="64MiB",
                           proxy_args=("--max-connections", str(MAX_CONNECTIONS),
                                       "--no-access-log"))
        with serving_cluster(spec) as cluster:
            for row in run_attacks(cluster.proxy_url, cluster.model_name):
                print(json.dumps(row) if args.json else _fmt(row), flush=True)
    return 0


def _fmt(row: dict[str, Any]) -> str:
    extra = f"  x{row['vs_solo']:.2f} of solo" if "vs_solo" in row else ""
    return f"{row['attack']:26} victim p50 {row['victim_ms']:8.1f} ms{extra}  {row['note']}"


def run_attacks(url: str, model: str) -> list[dict[str, Any]]:
    body = {"model": model, "prompt": "the victim asks", "max_tokens": 32, "temperature": 0,
            "ignore_eos": True}
    with httpx.Client(base_url=url, timeout=60) as http:
        def victim() -> float:
            t0 = time.perf_counter()
            reply = http.post("/v1/completions", json=body)
            if reply.status_code != 200:
                raise RuntimeError(f"the victim got {reply.status_code}: {reply.text[:200]}")
            return (time.perf_counter() - t0) * 1e3

        victim()  # warm
        solo = statistics.median(victim() for _ in range(VICTIM_RUNS))
        rows = [{"attack": "none (solo)", "victim_ms": round(solo, 1), "note": ""}]
        for name, attack in _attacks(url, model).items():
            with attack() as outcomes:
                time.sleep(1.0)  # the attack under way
                ms = statistics.median(victim() for _ in range(VICTIM_RUNS))
            rows.append({"attack": name, "victim_ms": round(ms, 1),
                         "vs_solo": round(ms / solo, 2), "note": _note(outcomes)})
    return rows


def _note(outcomes: Counter[str]) -> str:
    return "attacker: " + ", ".join(f"{k} x{v}" for k, v in sorted(outcomes.items()))


Attack = Callable[[], Any]


def _attacks(url: str, model: str) -> dict[str, Attack]:
    big = {"model": model, "prompt": "x " * (2_000_000 - 64), "max_tokens": 1}
    huge = b'{"model": "' + model.encode() + b'", "prompt": "' + b"y" * 12_000_000 + b'"}'
    stops = {"model": model, "prompt": "stop me", "max_tokens": 256, "ignore_eos": True,
             "stream": True, "stop": [f"{i:03d}" + "z" * 509 for i in range(16)]}
    plain = {k: v for k, v in stops.items() if k != "stop"}
    return {
        "largest body": lambda: _looping(url, 2, lambda h: h.post("/v1/completions", json=big)),
        "oversized body": lambda: _looping(url, 2, lambda h: h.post(
            "/v1/completions", content=huge, headers={"Content-Type": "application/json"})),
        "one plain stream": lambda: _looping(url, 1, lambda h: _stream(h, plain)),
        "stop strings at the cap": lambda: _looping(url, 1, lambda h: _stream(h, stops)),
        "silent connections": lambda: _sockets(url, 600, trickle=False),
        "trickled heads": lambda: _sockets(url, 200, trickle=True),
    }


def _stream(http: httpx.Client, body: dict[str, Any]) -> httpx.Response:
    with http.stream("POST", "/v1/completions", json=body) as reply:
        for _ in reply.iter_lines():
            pass
        return reply


@contextmanager
def _looping(url: str, clients: int,
             send: Callable[[httpx.Client], httpx.Response]) -> Iterator[Counter[str]]:
    """`clients` threads sending `send` back to back until the block ends."""
    outcomes: Counter[str] = Counter()
    done = threading.Event()

    def loop() -> None:
        with httpx.Client(base_url=url, timeout=60) as http:
            while not done.is_set():
                try:
                    outcomes[str(send(http).status_code)] += 1
                except httpx.HTTPError as exc:
                    outcomes[type(exc).__name__] += 1

    threads = [threading.Thread(target=loop, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    try:
        yield outcomes
    finally:
        done.set()
        for t in threads:
            t.join(60)


@contextmanager
def _sockets(url: str, count: int, trickle: bool) -> Iterator[Counter[str]]:
    """`count` connections that send nothing, or one byte of a request head a second; the
    outcome counts those the proxy closed by the end."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    outcomes: Counter[str] = Counter()
    socks = []
    for _ in range(count):
        try:
            socks.append(socket.create_connection((host, int(port)), timeout=5))
        except OSError as exc:
            outcomes[f"connect {type(exc).__name__}"] += 1
    done = threading.Event()

    def drip() -> None:
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
        for i in range(10_000):
            if done.wait(1.0):
                return
            for s in socks:
                try:
                    s.send(head[i % len(head):i % len(head) + 1])
                except OSError:
                    pass

    dripper = threading.Thread(target=drip, daemon=True)
    if trickle:
        dripper.start()
    try:
        yield outcomes
    finally:
        done.set()
        outcomes["closed by the proxy"] += sum(closed_by_peer(s) for s in socks)
        outcomes["still open"] = len(socks) - outcomes["closed by the proxy"]
        for s in socks:
            s.close()


def closed_by_peer(sock: socket.socket) -> bool:
    """Whether the other end has closed `sock` (it reads EOF, or an error), without waiting."""
    try:
        sock.setblocking(False)
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True
