"""KV events through the vllm backend, in real processes: two emulated vLLM instances publish
their KV events (as `--kv-events-config` makes vLLM do) to the endpoint `kvpool proxy --backend
vllm --kv-events` binds; a prompt sent again, extended, lands on the instance that holds its
prefix (the conductor's prefix match comes from the events, with hashes computed as vLLM
computes them). An instance whose hashes are seeded otherwise is said loudly: an error line and
the gauge at 1."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvpool.launch.ports import free_port
from kvpool.launch.wait import wait_for, wait_http
from tests.serve.vllm.conftest import BLOCK, NAME, Fleet, complete, events_config, prompt


@pytest.fixture(scope="module")
def fleet(emu_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    f = Fleet()
    logs = tmp_path_factory.mktemp("proxy")
    try:
        endpoint, other = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
        for name in ("c1", "c2"):
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            f.worker(name, emu_model, "--role", "both", "--api", "vllm", "--served-model-name",
                     NAME, "--kv-events-config", events_config(endpoint, url), port=port)
        port = free_port()
        f.worker("c3", emu_model, "--role", "both", "--api", "vllm", "--served-model-name",
                 NAME, "--kv-events-config",
                 events_config(other, f"http://127.0.0.1:{port}"), port=port,
                 env={"PYTHONHASHSEED": "12345"})
        f.proxy("events", emu_model, logs / "events.log", "--kv-events", endpoint,
                "--colocated", f.urls["c1"], "--colocated", f.urls["c2"])
        f.proxy("seeded", emu_model, logs / "seeded.log", "--kv-events", other,
                "--colocated", f.urls["c3"])
        for name in ("events", "seeded"):
            wait_http(f.urls[name] + "/health", f.procs, name, timeout_s=120)
        f.wait_joined("events", 2, 2)
        yield f
    finally:
        f.stop()


def gauges(url: str, name: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    out = {}
    for line in text.splitlines():
        if line.startswith(f"kvpool_proxy_engine_{name}{{"):
            worker = line.split('worker="', 1)[1].split('"', 1)[0]
            out[worker] = float(line.rsplit(" ", 1)[1])
    return out


def cached(r: httpx.Response) -> int:
    assert r.status_code == 200, r.text
    return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def wait_blocks(url: str, at_least: int) -> dict[str, float]:
    def indexed() -> dict[str, float] | None:
        blocks = gauges(url, "kv_events_blocks")
        return blocks if sum(blocks.values()) >= at_least else None

    return wait_for(indexed, 10.0, lambda: f"{at_least} blocks indexed by the proxy "
                    f"(have {gauges(url, 'kv_events_blocks')})", 0.05)


def test_a_prefix_sent_again_lands_where_it_is_cached(fleet: Fleet) -> None:
    url = fleet.urls["events"]
    num_blocks = 0
    for seed in range(4):
        p = prompt(200 + seed, 20 * BLOCK)
        assert cached(complete(url, p, 2)) == 0
        num_blocks += 20
        wait_blocks(url, num_blocks)
        assert cached(complete(url, p + [17, 18, 19], 2)) == 20 * BLOCK
    assert set(gauges(url, "kv_events_unmatched").values()) == {0.0}


def test_events_that_never_match_a_computed_hash_are_said_loudly(fleet: Fleet) -> None:
    url = fleet.urls["seeded"]
    for seed in range(20):
        assert complete(url, prompt(300 + seed, 2 * BLOCK), 1).status_code == 200
        time.sleep(0.06)  # its events arrive, so that later lookups meet its blocks
    wait_for(lambda: gauges(url, "kv_events_unmatched") == {fleet.urls["c3"]: 1.0}, 10.0,
             lambda: gauges(url, "kv_events_unmatched"), 0.1)
    log = fleet.proxy_logs["seeded"].read_text()
    assert "never match a computed block hash" in log and fleet.urls["c3"] in log, log


@pytest.mark.slow
def test_events_published_before_the_proxy_came_are_replayed(
        emu_model: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """The instance caches a prompt while nothing listens; the proxy, given its replay
    endpoint, reads those events back when the instance's next event shows it joined."""
    f = Fleet()
    try:
        port, endpoint = free_port(), f"tcp://127.0.0.1:{free_port()}"
        url, replay = f"http://127.0.0.1:{port}", f"tcp://127.0.0.1:{free_port()}"
        config = json.loads(events_config(endpoint, url)) | {"replay_endpoint": replay}
        f.worker("c", emu_model, "--role", "both", "--api", "vllm", "--served-model-name", NAME,
                 "--kv-events-config", json.dumps(config), port=port)
        wait_http(url + "/health", f.procs, "the instance", timeout_s=120)
        early = {"model": NAME, "prompt": prompt(400, 20 * BLOCK), "max_tokens": 1}
        assert httpx.post(url + "/v1/completions", json=early, timeout=60).status_code == 200
        time.sleep(0.3)  # published into the void
        f.proxy("replayed", emu_model, tmp_path_factory.mktemp("proxy") / "replayed.log",
                "--kv-events", endpoint, "--kv-events-replay", f"{url}={replay}",
                "--colocated", url)
        wait_http(f.urls["replayed"] + "/health", f.procs, "the proxy", timeout_s=120)
        assert cached(complete(f.urls["replayed"], prompt(401, 20 * BLOCK), 1)) == 0
        assert wait_blocks(f.urls["replayed"], 40) == {url: 40.0}
    finally:
        f.stop()
