"""Migration through the vllm backend, in real processes: the vLLM instance (`kvpool worker
--api vllm` over the tiny torch model: an autoregressive model, as vLLM's are; the emulated
engine's outputs are a function of the prompt alone, which a resume through vLLM's API
changes) streaming a greedy completion is SIGKILLed after some tokens; the proxy resumes the
request on the other instance (the tokens already sent as part of the prompt) and the client's
text equals an undisturbed run's, no token twice or missing."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvpool.launch.wait import wait_for, wait_http
from kvpool.serve.vllm.metrics_text import parse_metrics
from tests.serve.vllm.conftest import NAME, Fleet

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fleet(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    f = Fleet()
    try:
        for name in ("c1", "c2"):
            f.worker(name, tiny_model, "--role", "both", "--api", "vllm", "--served-model-name",
                     NAME, engine=())
        f.proxy("proxy", tiny_model, tmp_path_factory.mktemp("proxy") / "proxy.log",
                "--colocated", f.urls["c1"], "--colocated", f.urls["c2"])
        wait_http(f.urls["proxy"] + "/health", f.procs, "the proxy", timeout_s=120)
        f.wait_joined("proxy", 2, 2)
        yield f
    finally:
        f.stop()


def running_on(fleet: Fleet) -> str:
    def the_one() -> str | None:
        busy = [n for n in ("c1", "c2") if (m := parse_metrics(
            httpx.get(fleet.urls[n] + "/metrics", timeout=5).text)) and m.num_running > 0]
        return busy[0] if len(busy) == 1 else None

    return wait_for(the_one, 10.0, "a single instance to run the request", 0.05)


def test_a_killed_instance_hands_the_stream_over(fleet: Fleet) -> None:
    url = fleet.urls["proxy"]
    body = {"model": "tiny", "prompt": "the cache " * 30, "max_tokens": 800,
            "ignore_eos": True, "temperature": 0}
    whole = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert whole.status_code == 200, whole.text
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
            if len(texts) == 3:  # early: the stream must still be running
                victim = running_on(fleet)
                fleet.procs[["c1", "c2"].index(victim)].send_signal(signal.SIGKILL)
    assert events[-1] == "[DONE]" and "error" not in events[-2], events[-2:]
    assert "".join(texts) == whole.json()["choices"][0]["text"]
    metrics = httpx.get(url + "/metrics").text
    assert 'kvpool_proxy_migrations_total{leg="decode"} 1.0' in metrics
