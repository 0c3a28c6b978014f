"""Overload and failure over real workers: early rejection answers 429 with Retry-After; a
worker killed with SIGKILL mid-request ends its requests with a clean error, never a hang."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

from kvpool.launch.children import stop
from kvpool.launch.wait import wait_for, wait_http
from kvpool.serve.launch import ServingCluster
from tests.serve.conftest import start_proxy, start_worker


def test_overload_is_refused_with_429(cluster: ServingCluster, tmp_path: Path,
                                      capfd: pytest.CaptureFixture[str]) -> None:
    # Every prefill predicted at 0.2 s and a 0.5 s TTFT objective: of a burst on one prefill
    # worker, the first two fit and the queue refuses the rest, whatever the CPU's speed.
    # The workers join this proxy by registering (POST /workers/register), not by flags.
    cost = tmp_path / "cost.json"
    cost.write_text(json.dumps({"prefill_base_s": 0.2, "prefill_linear_s": 0.0,
                                "prefill_quadratic_s": 0.0}))
    proc, url = start_proxy(cluster.model_dir, "--ttft-slo", "0.5", "--cost", str(cost),
                            ready="/v1/models")
    try:
        assert httpx.get(url + "/health").status_code == 503  # no worker yet
        for urls in cluster.worker_urls.values():
            reply = httpx.post(url + "/workers/register", json={"url": urls[0]})
            assert reply.json() == {"ok": True, "url": urls[0]}
        assert httpx.post(url + "/workers/register", json={"nope": 1}).status_code == 400
        fragment = httpx.post(url + "/workers/register", json={"url": urls[0] + "#dp1"})
        assert fragment.status_code == 400 and "fragment" in fragment.text
        wait_http(url + "/health", [proc], "proxy with registered workers", timeout_s=30)

        async def burst() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                body = {"model": cluster.model_name, "prompt": "hello world", "max_tokens": 2}
                return list(await asyncio.gather(
                    *(http.post("/v1/completions", json=body) for _ in range(8))))

        codes = [r.status_code for r in asyncio.run(burst())]
        assert codes.count(200) == 2 and codes.count(429) == 6, codes
        refused = next(r for r in asyncio.run(burst()) if r.status_code == 429)
        assert int(refused.headers["Retry-After"]) >= 1
        err = refused.json()["error"]
        assert (err["type"], err["code"]) == ("rate_limit_exceeded", "rejected_ttft")
        metrics = httpx.get(url + "/metrics").text
        assert 'kvpool_proxy_rejections_total{reason="ttft",stage="arrival"}' in metrics
        assert 'kvpool_proxy_cost_prefill_term{model="cost_file",term="base"} 0.2' in metrics
        # the access log says which cost model refused what
        refusals = [line for line in capfd.readouterr().err.splitlines() if " 429 " in line]
        assert refusals and all("rejected_ttft cost=cost_file base=0.2s " in line
                                for line in refusals), refusals
        assert all(" prompt=0 " not in line for line in refusals), refusals  # their prompts
    finally:
        stop(proc)


def test_worker_killed_mid_request_ends_it_cleanly(cluster: ServingCluster) -> None:
    victim, victim_url = start_worker(cluster.model_dir, "decode", cluster)
    proxy, url = start_proxy(cluster.model_dir, "--prefill", cluster.worker_urls["prefill"][0],
                             "--decode", victim_url)
    body = {"model": cluster.model_name, "prompt": "the cache", "max_tokens": 2000,
            "ignore_eos": True, "temperature": 0}
    results: dict[str, object] = {}

    def non_streaming() -> None:
        results["plain"] = httpx.post(url + "/v1/completions", json=body, timeout=120)

    try:
        plain = threading.Thread(target=non_streaming)
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True},
                          timeout=120) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert '"text"' in first
            plain.start()
            time.sleep(0.3)
            victim.send_signal(signal.SIGKILL)
            killed_at = time.monotonic()
            rest = [line for line in lines if line.startswith("data: ")]
            ended_s = time.monotonic() - killed_at
        plain.join(60)
        assert not plain.is_alive()
        assert rest[-1] == "data: [DONE]"
        error = json.loads(rest[-2][6:])["error"]
        assert error["type"] == "worker_error" and victim_url in error["message"]
        assert ended_s < 15
        answer = results["plain"]
        assert isinstance(answer, httpx.Response) and answer.status_code == 502
        assert answer.json()["error"]["code"] == "worker_failed"
        wait_for(lambda: httpx.get(url + "/health").json()["decode"] == 0, 15.0,
                 "the dead worker to leave the rotation", 0.1)
        after = httpx.post(url + "/v1/completions", json={**body, "max_tokens": 2}, timeout=30)
        assert after.status_code == 503 and after.json()["error"]["code"] == "no_workers"
    finally:
        stop(victim)
        stop(proxy)


def test_a_client_that_goes_away_frees_its_request(cluster: ServingCluster) -> None:
    decode = cluster.worker_urls["decode"][0]
    body = {"model": cluster.model_name, "prompt": "the cache", "max_tokens": 2000,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", cluster.proxy_url + "/v1/completions", json=body,
                      timeout=60) as resp:
        lines = resp.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        assert httpx.get(decode + "/load").json()["num_running"] == 1
    wait_for(lambda: httpx.get(decode + "/load").json()["num_running"] == 0, 10.0,
             "the proxy to abort the abandoned request on the decode worker", 0.1)
    assert httpx.get(cluster.proxy_url + "/health").json()["ok"]


def _running_on(urls: list[str]) -> str:
    """The one of `urls` whose worker runs a request now."""
    def the_one() -> str | None:
        busy = [u for u in urls if httpx.get(u + "/load", timeout=5).json()["num_running"] > 0]
        return busy[0] if len(busy) == 1 else None

    return wait_for(the_one, 10.0, "a single decode worker to run the request", 0.05)


@pytest.mark.parametrize("flags,stream", [
    ((), True), pytest.param(("--worker-sse",), True, marks=pytest.mark.slow),
    pytest.param((), False, marks=pytest.mark.slow)], ids=["proxy-text", "worker-sse", "whole"])
def test_a_decode_worker_killed_mid_stream_hands_the_request_over(
        cluster: ServingCluster, flags: tuple[str, ...], stream: bool) -> None:
    """Two decode workers; the one streaming a greedy completion is SIGKILLed after some
    tokens: the stream goes on from another worker (the prompt's KV from the pool, the tokens
    sent recomputed) and its text equals an undisturbed run's, no token twice or missing.
    With --worker-sse the next worker's text chunks go on from the text the client has. A
    whole (not streamed) response, relayed in frames of --whole-interval tokens, is killed
    after a few of those frames: it goes on from the last one, the same body."""
    # (one after the other: a child started from a short-lived thread gets its parent-death
    # signal when that thread exits)
    workers = [start_worker(cluster.model_dir, "decode", cluster) for _ in range(2)]
    urls = [u for _, u in workers]
    proxy, url = start_proxy(cluster.model_dir, "--prefill", cluster.worker_urls["prefill"][0],
                             *(f for u in urls for f in ("--decode", u)), *flags)
    # long enough that the stream is still decoding when a busy client has read a few chunks
    # (the proxy may be hundreds of tokens ahead of the reader)
    body = {"model": cluster.model_name, "prompt": "the cache " * 30, "max_tokens": 800,
            "ignore_eos": True, "temperature": 0}
    try:
        whole = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert whole.status_code == 200, whole.text
        if not stream:
            again = _whole_killing_its_decode_worker(url, body, urls, workers)
            assert again.status_code == 200 and again.json()["choices"] == \
                whole.json()["choices"], again.text
            metrics = httpx.get(url + "/metrics").text
            assert 'kvpool_proxy_migrations_total{leg="decode"} 1.0' in metrics
            return
        texts: list[str] = []
        events: list[str] = []
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True},
                          timeout=120) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if line[6:] != "[DONE]":
                    texts.append(json.loads(line[6:])["choices"][0]["text"])
                if len(texts) == 3:
                    victim = _running_on(urls)
                    workers[urls.index(victim)][0].send_signal(signal.SIGKILL)
        assert events[-1] == "[DONE]" and "error" not in events[-2]
        assert "".join(texts) == whole.json()["choices"][0]["text"]
        metrics = httpx.get(url + "/metrics").text
        assert 'kvpool_proxy_migrations_total{leg="decode"} 1.0' in metrics
    finally:
        for proc, _ in workers:
            stop(proc)
        stop(proxy)


def _whole_killing_its_decode_worker(url: str, body: dict[str, object], urls: list[str],
                                     workers: list[tuple[subprocess.Popen[bytes], str]]
                                     ) -> httpx.Response:
    """`body` as one JSON response; its decode worker SIGKILLed once it has made 150 tokens
    more than when first seen running (a few 64-token frames relayed)."""
    answer: list[httpx.Response] = []
    call = threading.Thread(target=lambda: answer.append(
        httpx.post(url + "/v1/completions", json=body, timeout=120)))
    call.start()
    victim = _running_on(urls)
    start = httpx.get(victim + "/load", timeout=5).json()["running_tokens"]
    wait_for(lambda: httpx.get(victim + "/load", timeout=5).json()["running_tokens"] >=
             start + 150, 30.0, "150 tokens decoded", 0.01)
    workers[urls.index(victim)][0].send_signal(signal.SIGKILL)
    call.join(120)
    assert answer, "the whole response never came"
    return answer[0]


@pytest.mark.slow  # the stopped worker leaves the rotation after silent_dead_s (10 s)
def test_a_prefill_worker_stopped_before_its_first_token_leaves_the_prompt_to_decode(
        cluster: ServingCluster) -> None:
    prefill, prefill_url = start_worker(cluster.model_dir, "prefill", cluster)
    proxy, url = start_proxy(cluster.model_dir, "--prefill", prefill_url,
                             "--decode", cluster.worker_urls["decode"][0])
    body = {"model": cluster.model_name, "prompt": "a stopped worker", "max_tokens": 24,
            "ignore_eos": True, "temperature": 0}
    try:
        whole = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert whole.status_code == 200, whole.text
        prefill.send_signal(signal.SIGSTOP)
        again = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert again.status_code == 200, again.text
        assert again.json()["choices"][0]["text"] == whole.json()["choices"][0]["text"]
        assert 'kvpool_proxy_migrations_total{leg="prefill"} 1.0' in httpx.get(
            url + "/metrics").text
    finally:
        prefill.send_signal(signal.SIGCONT)
        stop(prefill)
        stop(proxy)
