"""A real vLLM of two data-parallel ranks behind the vllm backend (slow job; `$KVPOOL_VLLM_PYTHON`
as in test_real_vllm_live.py): vLLM's CPU build runs `--data-parallel-size 2` as two engine
cores, each with its own KV cache and KV-event publisher (rank 1 at the endpoint's port plus
one). The proxy names each rank (`URL#dp0`, `URL#dp1`): both ranks' events reach it, each
under its rank, and a prompt sent again runs on the rank that holds it, every time; sent to
vLLM itself, whose balancer routes by load, the same prompts find their cache on about half
their runs (said, not asserted: its balancer's choices are its own)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from kvpool.launch.wait import wait_http
from kvpool.serve.models import resolve_model
from kvpool.serve.vllm.metrics_text import METRICS_PATH, parse_metrics
from tests.serve.vllm.conftest import Fleet, real_vllm

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    logs = tmp_path_factory.mktemp("dp")
    with real_vllm(logs, "--data-parallel-size", "2") as f:
        url = f.urls["vllm"]
        f.proxy("proxy", resolve_model("smollm2"), logs / "proxy.log", "--colocated",
                f"{url}#dp0", "--colocated", f"{url}#dp1", "--kv-events", f.urls["events"])
        wait_http(url + "/health", f.procs, "vLLM", timeout_s=600)
        f.wait_joined("proxy", 2, 2)
        yield f


def _cached(url: str, model: str, prompt: list[int], max_tokens: int) -> int:
    r = httpx.post(url + "/v1/completions", timeout=300, json={
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True})
    assert r.status_code == 200, r.text
    return int((r.json()["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def _runs(url: str, model: str, tag: int) -> list[int]:
    """Eight 600-token prompts at once (the ranks share them), then each again, extended:
    the cached tokens of each second run."""
    prompts = [[1] + [300 + ((i + 977 * k + 7919 * tag) * 53) % 4000 for i in range(600)]
               for k in range(8)]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda p: _cached(url, model, p, 24), prompts))
    time.sleep(1.5)  # their events arrive
    return [_cached(url, model, p + [5, 6, 7], 2) for p in prompts]


def test_each_rank_is_an_instance_and_a_prompt_runs_where_it_is_cached(two_ranks: Fleet) -> None:
    proxy, vllm = two_ranks.urls["proxy"], two_ranks.urls["vllm"]
    through = _runs(proxy, two_ranks.urls["model"], 1)
    assert all(c >= 512 for c in through), through  # four full 128-token blocks, each time
    metrics = httpx.get(proxy + "/metrics").text
    blocks = {ln.split('"')[1]: float(ln.rsplit(" ", 1)[1]) for ln in metrics.splitlines()
              if ln.startswith("kvpool_proxy_engine_kv_events_blocks{")}
    assert blocks[f"{vllm}#dp0"] >= 4 and blocks[f"{vllm}#dp1"] >= 4, blocks
    unmatched = [ln for ln in metrics.splitlines()
                 if ln.startswith("kvpool_proxy_engine_kv_events_unmatched{")]
    assert unmatched and all(ln.endswith(" 0.0") for ln in unmatched), unmatched
    server = parse_metrics(httpx.get(vllm + METRICS_PATH).text)  # both engines' blocks
    assert server is not None and server.kv_capacity_tokens
    samples = httpx.get(proxy + "/stats/samples").json()  # a rank's: its own engine's half
    assert samples["kv_capacity_tokens"] * 2 == server.kv_capacity_tokens, samples
    direct = _runs(vllm, "smol", 2)  # vLLM's balancer: by load
    hits = [sum(c >= 512 for c in runs) for runs in (through, direct)]
    print(f"second runs that found their prompt cached: through the proxy {hits[0]}/8, "
          f"to vLLM itself {hits[1]}/8")
