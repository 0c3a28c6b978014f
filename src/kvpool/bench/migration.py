"""`kvpool bench migration`: what a decode worker's death costs a stream that is handed over.

One real cluster (master, store node, a prefill worker, the proxy) on the tiny model, with
decode workers started as needed. Each run streams a greedy completion, SIGKILLs the decode
worker serving it after `--kill-at` tokens, and starts a replacement for the next run. Per
run: the longest pause of the stream after the kill (the proxy sees the stream break, the
resumed worker loads the prompt's blocks from the pool and recomputes the tokens sent), beside
the inter-token gaps of an undisturbed stream of the same request in the same run; whether the
text equals the undisturbed one. p50 / p99 over the runs.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("migration", help="the gap a stream sees when its decode worker dies")
    p.add_argument("--runs", type=int, default=8)
    p.add_argument("--kill-at", type=int, default=16, help="tokens streamed before the kill")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    from kvpool.launch.ports import free_port
    from kvpool.serve.launch import ServingSpec, ensure_tiny_model, serving_cluster

    with tempfile.TemporaryDirectory() as tmp:
        model = ensure_tiny_model(Path(tmp) / "tiny")
        spec = ServingSpec(model, port=free_port(), dram="64MiB", num_decode=2,
                           proxy_args=("--no-access-log",))
        with serving_cluster(spec) as cluster:
            row = measure(cluster, args.runs, args.kill_at)
    print(json.dumps(row) if args.json else _fmt(row), flush=True)
    return 0


def _fmt(row: dict[str, Any]) -> str:
    return (f"resumed-stream gap p50 {row['gap_p50_ms']:.1f} ms, p99 {row['gap_p99_ms']:.1f} "
            f"ms (ordinary gaps p50 {row['tbt_p50_ms']:.1f} ms, p99 {row['tbt_p99_ms']:.1f} "
            f"ms); {row['exact']}/{row['runs']} streams equal to an undisturbed run")


def measure(cluster: Any, runs: int, kill_at: int) -> dict[str, Any]:
    from kvpool.launch.ports import free_port
    from kvpool.launch.store import start_ready
    from kvpool.metadata.http_serving import bearer_header
    from kvpool.token import env_token

    body = {"model": cluster.model_name, "prompt": "the cache " * 30, "max_tokens": 256,
            "ignore_eos": True, "temperature": 0}
    url = cluster.proxy_url
    base_stamps, base_texts = _stream_and_kill(url, body, 0, workers={})
    expected = "".join(base_texts)
    tbts = [b - a for a, b in zip(base_stamps, base_stamps[1:], strict=False)]
    decode = [p for name, p in cluster.procs.items() if name.startswith("decode-")]
    workers = dict(zip(cluster.worker_urls["decode"], decode, strict=True))
    gaps, exact = [], 0
    with ExitStack() as replacements:
        for _ in range(runs):
            stamps, texts = _stream_and_kill(url, body, kill_at, workers)
            deltas = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
            gaps.append(max(deltas[kill_at - 1:]))  # the pause that follows the kill
            exact += "".join(texts) == expected
            port = free_port()  # a replacement, so that the next run has two again
            proc = start_ready(replacements, "worker", "--role", "decode",
                               "--model", str(cluster.model_dir), "--host", cluster.host,
                               "--port", str(port), "--master", cluster.master_address,
                               what="a replacement worker", timeout_s=120)
            new = f"http://{cluster.host}:{port}"
            workers[new] = proc
            httpx.post(url + "/workers/register", json={"url": new},
                       headers=bearer_header(env_token()))
            time.sleep(1.0)  # joined by the proxy's poller
    q = statistics.quantiles
    return {"runs": runs, "kill_at": kill_at, "exact": exact,
            "gap_p50_ms": round(statistics.median(gaps) * 1e3, 1),
            "gap_p99_ms": round(q(gaps, n=100)[98] * 1e3 if len(gaps) > 1 else gaps[0] * 1e3, 1),
            "tbt_p50_ms": round(statistics.median(tbts) * 1e3, 1),
            "tbt_p99_ms": round(q(tbts, n=100)[98] * 1e3, 1),
            "gaps_ms": [round(g * 1e3, 1) for g in gaps]}


def _stream_and_kill(url: str, body: dict[str, Any], kill_at: int,
                     workers: dict[str, subprocess.Popen[bytes]]) -> tuple[list[float], list[str]]:
    stamps: list[float] = []
    texts: list[str] = []
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True},
                      timeout=120) as resp:
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            stamps.append(time.perf_counter())
            texts.append(json.loads(line[6:])["choices"][0]["text"])
            if kill_at and len(texts) == 1:
                victim = _busy_decode_worker(workers)
            if kill_at and len(texts) == kill_at:
                victim.send_signal(signal.SIGKILL)
    return stamps, texts


def _busy_decode_worker(workers: dict[str, subprocess.Popen[bytes]]) -> subprocess.Popen[bytes]:
    """The decode worker of `workers` (URL -> process) that runs a request now."""
    for worker, proc in workers.items():
        if proc.poll() is None and httpx.get(worker + "/load", timeout=5).json()["num_running"]:
            return proc
    raise RuntimeError("no decode worker runs the request")
