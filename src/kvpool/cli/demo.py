"""The workloads `kvpool up --demo` runs: requests through the serving cluster's proxy
(`run_serving_demo`), or store operations against a store-only cluster (`run_demo`)."""

from __future__ import annotations

import hashlib
import json
import signal
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import httpx
import numpy as np

from kvpool.metadata.http_serving import bearer_header
from kvpool.store.client.config import ClientConfig
from kvpool.store.client.store_client import StoreClient
from kvpool.store.config import ReplicateConfig
from kvpool.token import env_token

if TYPE_CHECKING:
    from kvpool.cli.local_cluster import LocalCluster
    from kvpool.serve.launch import ServingCluster

NUM_OBJECTS = 64
OBJECT_BYTES = 256 << 10
BATCH_KEYS = 32
BATCH_OBJECT_BYTES = 1 << 20


DEMO_PROMPTS = ("The cache block pool", "hello world, the prefill")
_WORDS = ("the prefill of the prompt can read the cache block from the pool and the decode "
          "can write the token to the store").split()


def run_serving_demo(cluster: ServingCluster) -> int:
    """A few streamed requests, then one long prompt cold and again with its prefix cached."""
    with httpx.Client(base_url=cluster.proxy_url + "/v1", timeout=300) as http:
        model = cluster.model_name
        for prompt in DEMO_PROMPTS:
            print(f"demo: completion {prompt!r} -> ", end="", flush=True)
            _print_stream(http, "/completions", {"model": model, "prompt": prompt,
                                                 "max_tokens": 24, "temperature": 0})
        print("demo: chat 'What is a KV cache?' -> ", end="", flush=True)
        _print_stream(http, "/chat/completions", {
            "model": model, "max_tokens": 24, "temperature": 0,
            "messages": [{"role": "user", "content": "What is a KV cache?"}]})
        max_len = int(http.get("/models").json()["data"][0]["max_model_len"])
        _long_prompt_ttft(http, model, max_len)
    metrics = httpx.get(cluster.proxy_url + "/metrics", timeout=10,
                        headers=bearer_header(env_token())).text.splitlines()
    for line in metrics:
        if line.startswith(("kvpool_proxy_prefix_hit_tokens_total", "kvpool_proxy_prompt_tokens_total",
                            "kvpool_proxy_ttft_seconds_count", "kvpool_proxy_rejections_total")):
            print(f"  {line}")
    print("demo: done", flush=True)
    return 0


def _events(http: httpx.Client, path: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
    with http.stream("POST", path, json={**body, "stream": True,
                                         "stream_options": {"include_usage": True}}) as resp:
        if resp.status_code != 200:
            raise httpx.HTTPStatusError(f"{path}: HTTP {resp.status_code} {resp.read()!r}",
                                        request=resp.request, response=resp)
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                yield json.loads(line[6:])


def _piece(event: dict[str, Any]) -> str:
    if not event.get("choices"):
        return ""
    choice = event["choices"][0]
    return str(choice.get("text") or choice.get("delta", {}).get("content") or "")


def _print_stream(http: httpx.Client, path: str, body: dict[str, Any]) -> None:
    for event in _events(http, path, body):
        print(_piece(event), end="", flush=True)
    print(flush=True)


def _ttft(http: httpx.Client, body: dict[str, Any]) -> tuple[float, int, int]:
    """(seconds to the first token, prompt tokens, prompt tokens reused)."""
    start = time.perf_counter()
    ttft = 0.0
    use: dict[str, Any] = {}
    for event in _events(http, "/completions", body):
        if not ttft and event.get("choices"):
            ttft = time.perf_counter() - start
        use = event.get("usage") or use
    cached = int((use.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
    return ttft, int(use.get("prompt_tokens", 0)), cached


def _long_prompt_ttft(http: httpx.Client, model: str, max_len: int) -> None:
    words = (_WORDS * (max_len // len(_WORDS) + 1))[: max(64, max_len // 3)]
    shared = " ".join(words)
    cold = _ttft(http, {"model": model, "prompt": shared + " first question:", "max_tokens": 4})
    warm = _ttft(http, {"model": model, "prompt": shared + " second question:", "max_tokens": 4})
    print(f"demo: long prompt of {cold[1]} tokens: TTFT cold {cold[0] * 1e3:.1f} ms "
          f"({cold[2]} tokens reused); same prefix again: TTFT {warm[0] * 1e3:.1f} ms "
          f"({warm[2]} tokens reused from the cache/pool)", flush=True)


def _payload(key: str, size: int) -> bytes:
    seed = np.frombuffer(hashlib.blake2b(key.encode(), digest_size=64).digest(), np.uint8)
    return np.resize(seed, size).tobytes()


def run_demo(cluster: LocalCluster, bench: bool = True) -> int:
    config = ClientConfig(master=cluster.master_address, local_hostname=cluster.host,
                          metadata=cluster.metadata_url, local_buffer_size=64 << 20)
    with StoreClient(config) as client:
        ok = _replicated_puts(client) and _zero_copy_batches(client) and _survive_kill(client, cluster)
    _print_admin(cluster)
    if ok and bench:
        _transfer_bench()
    print("demo: " + ("all checks passed" if ok else "FAILED"), flush=True)
    return 0 if ok else 1


def _replicated_puts(client: StoreClient) -> bool:
    two = ReplicateConfig(replica_num=2)
    keys = [f"demo/block/{i}" for i in range(NUM_OBJECTS)]
    start = time.perf_counter()
    puts = [client.put(key, _payload(key, OBJECT_BYTES), two) for key in keys]
    put_s = time.perf_counter() - start
    start = time.perf_counter()
    gets = [client.get(key) for key in keys]
    get_s = time.perf_counter() - start
    good = all(p.ok for p in puts) and all(g.ok and g.data == _payload(k, OBJECT_BYTES)
                                           for k, g in zip(keys, gets, strict=True))
    print(f"demo: {NUM_OBJECTS} x {OBJECT_BYTES >> 10} KiB objects, 2 replicas each: "
          f"put {NUM_OBJECTS / put_s:,.0f}/s, get {NUM_OBJECTS / get_s:,.0f}/s, "
          f"content verified: {good}", flush=True)
    return good


def _zero_copy_batches(client: StoreClient) -> bool:
    src = np.random.default_rng(0).integers(0, 256, BATCH_KEYS * BATCH_OBJECT_BYTES, dtype=np.uint8)
    dst = np.zeros_like(src)
    client.register_buffer(src)
    client.register_buffer(dst)
    keys = [f"demo/batch/{i}" for i in range(BATCH_KEYS)]
    addrs = [src.ctypes.data + i * BATCH_OBJECT_BYTES for i in range(BATCH_KEYS)]
    sizes = [BATCH_OBJECT_BYTES] * BATCH_KEYS
    start = time.perf_counter()
    puts = client.batch_put_from(keys, addrs, sizes)
    put_s = time.perf_counter() - start
    start = time.perf_counter()
    reads = client.batch_get_into(keys, [a - src.ctypes.data + dst.ctypes.data for a in addrs], sizes)
    get_s = time.perf_counter() - start
    good = all(p.ok for p in puts) and all(r.ok for r in reads) and bool((src == dst).all())
    total = BATCH_KEYS * BATCH_OBJECT_BYTES / 1e9
    print(f"demo: zero-copy batch of {BATCH_KEYS} x 1 MiB: put {total / put_s:.2f} GB/s, "
          f"get {total / get_s:.2f} GB/s, content verified: {good}", flush=True)
    return good


def _survive_kill(client: StoreClient, cluster: LocalCluster) -> bool:
    victim = cluster.nodes[0]
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    keys = [f"demo/block/{i}" for i in range(NUM_OBJECTS)]
    gets = [client.get(key) for key in keys]
    intact = sum(g.ok and g.data == _payload(k, OBJECT_BYTES) for k, g in zip(keys, gets, strict=True))
    wrong = sum(g.ok and g.data != _payload(k, OBJECT_BYTES) for k, g in zip(keys, gets, strict=True))
    print(f"demo: killed store node pid {victim.pid} (SIGKILL); replicated objects still readable: "
          f"{intact}/{NUM_OBJECTS}, wrong bytes returned: {wrong}", flush=True)
    return intact == NUM_OBJECTS and wrong == 0


def _print_admin(cluster: LocalCluster) -> None:
    segments = cluster.admin("/segments").json()
    print(f"demo: master reports {len(segments)} mounted segment(s)")
    metrics = cluster.admin("/metrics").text.splitlines()
    shown = [line for line in metrics if line.startswith(("kvpool_keys", "kvpool_ops_total"))][:6]
    for line in shown:
        print(f"  {line}")


def _transfer_bench() -> None:
    import argparse

    from kvpool.bench.transfer import run

    print("\ntransfer engine, target in another process (kvpool bench transfer --quick):", flush=True)
    run(argparse.Namespace(quick=True, sizes=None, transports="tcp,shm", no_mooncake=False,
                           seconds=None, json=False))
