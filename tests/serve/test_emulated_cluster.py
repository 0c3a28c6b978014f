"""A 2P2D emulated cluster in real processes (master, workers, proxy; the test process
contributes the pool's only memory, so it can damage a stored byte): outputs equal their
expected function of the prompt through the pool and by push, a prefix one prefill worker
stored is used by the other, a damaged KV byte in the pool is refused (checksum), dropped and
computed again (never output, never a failed request), the proxy's view of cached blocks
follows the workers by events, and failed decode legs neither fail a complete output nor
leave a request's partial block (`kvreq/`) in the pool."""

from __future__ import annotations

import ctypes
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvpool.engine.blocks import block_key, prefix_block_hashes, request_key
from kvpool.engine.emulated.kvbytes import expected_output, ordinary_vocab
from kvpool.launch.children import stop
from kvpool.launch.ports import free_port
from kvpool.launch.wait import wait_for
from kvpool.serve.launch import ServingCluster, ServingSpec, ensure_emulated_model, serving_cluster
from kvpool.store.wire.codes import ErrorCode

BLOCK = 16
WORKER_ARGS = ("--engine", "emulated", "--speed-up", "20", "--block-size", str(BLOCK),
               "--max-model-len", "8192", "--max-prefill-chunk", "8192", "--num-blocks", "512")


@pytest.fixture(scope="module")
def emulated_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_emulated_model(tiny_model, tmp_path_factory.mktemp("emu") / "m", 8192)


@pytest.fixture(scope="module")
def pool(emulated_model: Path) -> Iterator[tuple[ServingCluster, Any]]:
    from kvpool.store.client.config import ClientConfig
    from kvpool.store.client.store_client import StoreClient

    spec = ServingSpec(emulated_model, port=free_port(), num_prefill=2, num_decode=2,
                       num_store_nodes=0, worker_args=WORKER_ARGS,
                       proxy_args=("--prefill-policy", "kvcache_centric", "--admission", "none"))
    with serving_cluster(spec) as cluster:
        with StoreClient(ClientConfig(master=cluster.master_address,
                                      global_segment_size=64 << 20)) as store:
            yield cluster, store


def facts(url: str) -> dict[str, Any]:
    return httpx.get(url + "/info", timeout=10).json()


def expected(info: dict[str, Any], prompt: list[int], n: int) -> list[int]:
    e = info["engine"]
    return expected_output(prompt, n, info["block_size"], info["model_hash"], e["kv_layers"],
                           e["row_bytes"], ordinary_vocab(512))


def complete(url: str, model: str, prompt: list[int], n: int, **extra: Any) -> httpx.Response:
    return httpx.post(url + "/v1/completions", timeout=60, json={
        "model": model, "prompt": prompt, "max_tokens": n, "temperature": 0,
        "ignore_eos": True, "kvpool_trace": True, **extra})


def prompt(seed: int, n: int) -> list[int]:
    return [16 + (seed * 7919 + i * 104729) % 496 for i in range(n)]


def test_what_the_emulated_engine_cannot_do_is_a_400(pool: tuple[ServingCluster, Any]) -> None:
    """It computes no logits: logprobs or a logit_bias are the client's 400 naming why, not
    a 502 (the worker refused the request, it did not fail)."""
    cluster, _ = pool
    for extra in ({"logprobs": 2}, {"logit_bias": {"20": 5}}):
        r = complete(cluster.proxy_url, cluster.model_name, prompt(3, 20), 2, **extra)
        assert r.status_code == 400, r.text
        assert "computes no logits" in r.json()["error"]["message"]


def test_outputs_through_the_pool_and_by_push(pool: tuple[ServingCluster, Any],
                                              emulated_model: Path) -> None:
    cluster, _ = pool
    info = facts(cluster.worker_urls["prefill"][0])
    assert info["engine"]["kind"] == "emulated"
    for i, length in enumerate((17, 100, 333)):
        p = prompt(i, length)
        r = complete(cluster.proxy_url, cluster.model_name, p, 12)
        assert r.status_code == 200, r.text
        assert r.json()["kvpool_trace"]["token_ids"] == expected(info, p, 12)


def test_push_mode(pool: tuple[ServingCluster, Any], emulated_model: Path) -> None:
    from tests.serve.conftest import start_proxy

    cluster, _ = pool
    info = facts(cluster.worker_urls["prefill"][0])
    flags = [f for role, urls in cluster.worker_urls.items() for u in urls
             for f in ("--decode" if role == "decode" else "--prefill", u)]
    proc, url = start_proxy(emulated_model, *flags, "--kv-transfer", "push", "--admission", "none")
    try:
        for i, length in enumerate((40, 257)):
            p = prompt(100 + i, length)
            r = complete(url, cluster.model_name, p, 9)
            assert r.status_code == 200, r.text
            assert r.json()["kvpool_trace"]["token_ids"] == expected(info, p, 9)
    finally:
        proc.terminate()
        proc.wait(10)


def test_a_prefix_stored_by_one_prefill_worker_is_used_by_the_other(
        pool: tuple[ServingCluster, Any]) -> None:
    cluster, _ = pool
    a, b = cluster.worker_urls["prefill"]
    info = facts(a)
    shared = prompt(7, 160)
    first = {"request_id": "px-1", "prompt_token_ids": shared + [20, 21],
             "sampling": {"max_tokens": 1}, "kv_transfer": {"mode": "pool"}}
    assert httpx.post(a + "/prefill", json=first, timeout=30).status_code == 200
    second = {"request_id": "px-2", "prompt_token_ids": shared + [30, 31, 32],
              "sampling": {"max_tokens": 1}, "kv_transfer": {"mode": "pool"}}
    reply = httpx.post(b + "/prefill", json=second, timeout=30).json()
    assert reply["num_pool_tokens"] == 160 and reply["num_cached_tokens"] == 0
    assert reply["first_token_id"] == expected(info, shared + [30, 31, 32], 1)[0]
    for url, rid in ((a, "px-1"), (b, "px-2")):  # no decode leg: drop their partial blocks
        assert httpx.post(url + "/abort", json={"request_id": rid}, timeout=30).status_code == 200


def counters(url: str) -> dict[str, float]:
    """The worker's /metrics as name -> value."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def summed(urls: list[str]) -> dict[str, float]:
    out: dict[str, float] = {}
    for url in urls:
        for name, value in counters(url).items():
            out[name] = out.get(name, 0.0) + value
    return out


def flip(store: Any, key: str, at: int) -> None:
    """Damage one byte of the only replica of `key` (the test holds the pool's memory)."""
    (replica,) = store.replica_desc(key).replicas
    ctypes.c_ubyte.from_address(replica.addr + at).value ^= 0x40


def test_a_damaged_kv_byte_is_dropped_and_the_decode_leg_computes_it(
        pool: tuple[ServingCluster, Any]) -> None:
    """A decode leg reading a damaged block: the store client refuses the bytes and has the
    master drop them, the worker computes that KV instead (output exact, never the damaged
    bytes), leaves no partial block behind; the next prefill of the prefix puts the block
    again."""
    cluster, store = pool
    a, b = cluster.worker_urls["prefill"]
    decode = cluster.worker_urls["decode"][0]
    info = facts(a)
    p = prompt(11, 5 * BLOCK + 3)
    body = {"request_id": "dmg-1", "prompt_token_ids": p, "sampling": {"max_tokens": 1},
            "kv_transfer": {"mode": "pool"}}
    first = httpx.post(a + "/prefill", json=body, timeout=30).json()
    assert first["first_token_id"] == expected(info, p, 1)[0]
    key = block_key(prefix_block_hashes(p, BLOCK, info["model_hash"])[2], 1)
    flip(store, key, 100)
    before = counters(decode)
    gen = {"request_id": "dmg-1", "prompt_token_ids": p, "sampling": {"max_tokens": 6},
           "first_token_id": first["first_token_id"], "kv_source": "pool"}
    lines = httpx.post(decode + "/generate", json=gen, timeout=30).text.splitlines()
    tokens = [t for line in lines for t in json.loads(line).get("token_ids", [])]
    assert tokens == expected(info, p, 6) and '"finish_reason"' in lines[-1], lines
    after = counters(decode)
    assert {k: after[k] - before[k] for k in after} == {
        "kvpool_worker_pool_damaged_reads_total": 1,
        "kvpool_worker_pool_damaged_dropped_total": 1,
        "kvpool_worker_pool_recomputed_total": 1}
    assert store.replica_desc(key).code == ErrorCode.OBJECT_NOT_FOUND
    assert store.replica_desc(request_key("dmg-1")).code == ErrorCode.OBJECT_NOT_FOUND
    # another prefill worker takes blocks 0 and 1 from the pool, computes and puts the rest
    other = httpx.post(b + "/prefill", json=body | {"request_id": "dmg-2"}, timeout=30).json()
    assert other["num_pool_tokens"] == 2 * BLOCK
    assert other["first_token_id"] == expected(info, p, 1)[0]
    assert httpx.post(b + "/abort", json={"request_id": "dmg-2"}, timeout=30).status_code == 200
    assert store.get(key).ok  # there again, and it passes the checksum


def test_the_first_request_after_a_damaged_block_is_served_exact(
        pool: tuple[ServingCluster, Any]) -> None:
    """Through the proxy: a byte flipped in a pooled block of a prompt that one prefill
    worker computed (so no decode worker holds it: the decode leg reads the pool); the next
    request of that prompt is served (200) with the undamaged run's tokens, the damaged
    replica is dropped once, and the request after it finds the pool whole again."""
    cluster, store = pool
    a = cluster.worker_urls["prefill"][0]
    info = facts(a)
    workers = [u for urls in cluster.worker_urls.values() for u in urls]
    p = prompt(12, 6 * BLOCK + 5)
    want = expected(info, p, 8)
    body = {"request_id": "heal-0", "prompt_token_ids": p, "sampling": {"max_tokens": 1},
            "kv_transfer": {"mode": "pool"}}
    assert httpx.post(a + "/prefill", json=body, timeout=30).json()["first_token_id"] == want[0]
    assert httpx.post(a + "/abort", json={"request_id": "heal-0"}, timeout=30).status_code == 200
    key = block_key(prefix_block_hashes(p, BLOCK, info["model_hash"])[3], 0)
    flip(store, key, 7)
    before = summed(workers)
    again = complete(cluster.proxy_url, cluster.model_name, p, 8)
    assert again.status_code == 200, again.text
    assert again.json()["kvpool_trace"]["token_ids"] == want
    after = summed(workers)
    assert after["kvpool_worker_pool_damaged_dropped_total"] - \
        before["kvpool_worker_pool_damaged_dropped_total"] == 1
    third = complete(cluster.proxy_url, cluster.model_name, p, 8)
    assert third.status_code == 200 and third.json()["kvpool_trace"]["token_ids"] == want
    assert store.get(key).ok and summed(workers) == after
    print(f"\nfirst request after the flip: {again.status_code}, tokens "
          f"{again.json()['kvpool_trace']['token_ids']} (undamaged: {want}); recomputed by "
          f"{after['kvpool_worker_pool_recomputed_total'] - before['kvpool_worker_pool_recomputed_total']:.0f} "
          "decode leg(s)")


def test_the_proxys_block_view_follows_the_workers_by_events(
        pool: tuple[ServingCluster, Any]) -> None:
    cluster, _ = pool
    url = cluster.worker_urls["prefill"][0]
    full = httpx.get(url + "/load", timeout=10).json()
    assert "block_hashes" in full and full["events_to"] >= len(full["block_hashes"])
    same = httpx.get(url + "/load", params={"epoch": full["epoch"], "since": full["events_to"]},
                     timeout=10).json()
    assert same["block_events"] == [] and "block_hashes" not in same
    stale = httpx.get(url + "/load", params={"epoch": "another-worker", "since": 0}).json()
    assert sorted(stale["block_hashes"]) == sorted(full["block_hashes"])  # a resync
    ahead = httpx.get(url + "/load", params={"epoch": full["epoch"],
                                             "since": full["events_to"] + 5}).json()
    assert "block_hashes" in ahead


def test_runs_leave_no_request_kv_in_the_pool(pool: tuple[ServingCluster, Any]) -> None:
    """A one-token request ends at the prefill's token, and an aborted one never reaches its
    decode leg: neither leaves its last block behind."""
    cluster, _ = pool
    ids = ["orphan"]
    for i in range(3):
        r = complete(cluster.proxy_url, cluster.model_name, prompt(300 + i, 3 * BLOCK + 5), 1)
        assert r.status_code == 200, r.text
        ids.append(r.json()["id"])
    a = cluster.worker_urls["prefill"][0]
    body = {"request_id": "orphan", "prompt_token_ids": prompt(400, 2 * BLOCK + 1),
            "sampling": {"max_tokens": 4}, "kv_transfer": {"mode": "pool"}}
    assert httpx.post(a + "/prefill", json=body, timeout=30).status_code == 200
    assert httpx.post(a + "/abort", json={"request_id": "orphan"}, timeout=30).status_code == 200
    keys = httpx.get(cluster.admin_url + "/keys", params={"prefix": "kvreq/"}, timeout=10).json()
    assert not {request_key(i) for i in ids} & set(keys["keys"]), keys


def test_a_resume_with_nothing_left_to_do_finishes_at_once(
        pool: tuple[ServingCluster, Any]) -> None:
    """A decode leg resumed with tokens that already end the request (max_tokens reached, or
    a stop token) answers its finish line, not a refusal."""
    cluster, _ = pool
    decode = cluster.worker_urls["decode"][0]
    p = prompt(600, 2 * BLOCK + 3)
    for sampling, resumed, reason in (({"max_tokens": 2}, [40, 41], "length"),
                                      ({"max_tokens": 9, "stop_token_ids": [41]}, [40, 41],
                                       "stop")):
        gen = {"request_id": f"over-{reason}", "prompt_token_ids": p, "sampling": sampling,
               "resume_output_ids": resumed}
        reply = httpx.post(decode + "/generate", json=gen, timeout=30)
        assert reply.status_code == 200, reply.text
        (line,) = [json.loads(x) for x in reply.text.splitlines()]
        assert line["finish_reason"] == reason and line["num_output_tokens"] == 0, line


def kvreq_keys(cluster: ServingCluster) -> list[str]:
    keys = httpx.get(cluster.admin_url + "/keys", params={"prefix": "kvreq/"}, timeout=10)
    return list(keys.json()["keys"])


def test_failed_decode_legs_fail_no_complete_output_and_leave_no_partial_block(
        pool: tuple[ServingCluster, Any], emulated_model: Path) -> None:
    """Runs last: it kills one of the module's decode workers. A proxy that polls every 5 s
    over both; the one every idle booking goes to (the first URL) is SIGKILLed before the
    proxy can notice. A max_tokens 1 request, whose only token came from the prefill, is
    complete: 200, whatever its decode leg does. An 8-token request resumes on the other
    worker, exact. No request leaves its partial block (`kvreq/`) in the pool."""
    from tests.serve.conftest import start_proxy

    cluster, _ = pool
    a = cluster.worker_urls["prefill"][0]
    info = facts(a)
    victim, survivor = sorted(cluster.worker_urls["decode"])
    proxy, url = start_proxy(emulated_model, "--prefill", a, "--decode", victim,
                             "--decode", survivor, "--poll-interval", "5", "--admission", "none")
    try:
        port = victim.rsplit(":", 1)[1]
        doomed = next(p for p in cluster.procs.values() if port in list(p.args))  # type: ignore[arg-type]
        doomed.kill()
        doomed.wait()
        p = prompt(500, 3 * BLOCK + 5)
        one = complete(url, cluster.model_name, p, 1)
        assert one.status_code == 200, one.text
        assert one.json()["kvpool_trace"]["token_ids"] == expected(info, p, 1)
        assert one.json()["choices"][0]["finish_reason"] == "length"
        q = prompt(501, 4 * BLOCK + 7)
        eight = complete(url, cluster.model_name, q, 8)
        assert eight.status_code == 200, eight.text
        assert eight.json()["kvpool_trace"]["token_ids"] == expected(info, q, 8)
        assert 'kvpool_proxy_migrations_total{leg="decode"} 1.0' in httpx.get(
            url + "/metrics").text
        # the prefill worker's abort runs in the background
        wait_for(lambda: kvreq_keys(cluster) == [], 5.0,
                 lambda: f"no kvreq keys left (have {kvreq_keys(cluster)})", 0.05)
    finally:
        stop(proxy)


def test_a_long_prompt_prepared_in_a_thread_is_exact_and_found_again(
        pool: tuple[ServingCluster, Any]) -> None:
    """A body over the proxy's inline limit (tokenized in a thread, app._prepared): the
    output is the prompt's function, and the same prompt again finds its prefix cached."""
    cluster, _ = pool
    info = facts(cluster.worker_urls["prefill"][0])
    p = prompt(11, 2600)
    assert len(json.dumps({"prompt": p})) > 8192  # app.INLINE_PREPARE_BYTES
    first = complete(cluster.proxy_url, cluster.model_name, p, 6)
    again = complete(cluster.proxy_url, cluster.model_name, p, 6)
    for r in (first, again):
        assert r.status_code == 200, r.text
        assert r.json()["kvpool_trace"]["token_ids"] == expected(info, p, 6)
    cached = again.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 2600 // info["block_size"] * info["block_size"] - info["block_size"]
