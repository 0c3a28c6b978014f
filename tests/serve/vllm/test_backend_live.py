"""The vllm backend against emulated vLLM instances in real processes (`kvpool worker --api
vllm`, vLLM's endpoints over kvpool's emulated engine): `kvpool proxy --backend vllm` serves
completions over two colocated instances, token-exact against the same engine's outputs as
kvpool's workers serve them; configured URLs that never join (nothing there, not a vLLM) are
logged with the reason; an instance serving another model is refused. The prefill/decode pair
through the pool is test_backend_pd_live.py (slow job)."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvpool.errors import InvalidArgument
from kvpool.launch.ports import free_port
from kvpool.launch.wait import wait_for, wait_http
from kvpool.serve.vllm.backend import VllmBackend, model_hash
from tests.serve.vllm.conftest import (
    BLOCK,
    NAME,
    Fleet,
    complete,
    native_expected,
    prompt,
    streamed,
)


@pytest.fixture(scope="module")
def fleet(emu_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """Two colocated instances behind a proxy that is also given a URL with nothing there and
    one that answers HTTP but is no vLLM; all started at once (the proxy polls until its
    instances join)."""
    f = Fleet()
    try:
        c1 = f.worker("c1", emu_model, "--role", "both", "--api", "vllm",
                      "--served-model-name", NAME)
        f.worker("c2", emu_model, "--role", "both", "--api", "vllm", "--served-model-name", NAME)
        f.urls["dead"] = dead = f"http://127.0.0.1:{free_port()}"
        f.urls["other"] = other = c1 + "/not-here"
        f.proxy("colocated", emu_model, tmp_path_factory.mktemp("proxy") / "colocated.log", "--colocated", c1,
                "--colocated", f.urls["c2"], "--colocated", dead, "--colocated", other)
        wait_http(f.urls["colocated"] + "/health", f.procs, "the proxy", timeout_s=120)
        f.wait_joined("colocated", 2, 2)
        yield f
    finally:
        f.stop()


def test_colocated_instances_serve_token_exact(fleet: Fleet) -> None:
    url = fleet.urls["colocated"]
    health = httpx.get(url + "/health", timeout=10).json()
    assert (health["prefill"], health["decode"]) == (2, 2), health
    for i, length in enumerate((5, 40, 300)):
        p = prompt(i, length)
        r = complete(url, p, 10)
        assert r.status_code == 200, r.text
        assert r.json()["kvpool_trace"]["token_ids"] == native_expected(fleet, p, 10)


def test_streaming_and_what_the_backend_does_not_serve(fleet: Fleet) -> None:
    url = fleet.urls["colocated"]
    p = prompt(70, 33)
    whole = complete(url, p, 6).json()
    assert whole["kvpool_trace"]["token_ids"] == native_expected(fleet, p, 6)
    assert streamed(url, p, 6) == (whole["choices"][0]["text"], 6)
    refused = complete(url, p, 2, echo=True, logprobs=1)
    assert refused.status_code == 400 and "prompt_logprobs" in refused.text


def _relayed_frames(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return float(re.search(r"^kvpool_proxy_read_relay_frames_total (\S+)$", text, re.M)
                 .group(1))  # type: ignore[union-attr]


def test_a_long_stream_is_relayed_in_the_read_callback(fleet: Fleet) -> None:
    """vLLM's stream chunks of tokens, taken in the read callback (most of a 200-token
    stream's), give the text and the token count the whole response gives."""
    url = fleet.urls["colocated"]
    p = prompt(71, 20)
    whole = complete(url, p, 200).json()
    before = _relayed_frames(url)
    assert streamed(url, p, 200) == (whole["choices"][0]["text"], 200)
    assert _relayed_frames(url) - before > 50


def test_urls_that_do_not_join_are_logged_with_the_reason(fleet: Fleet) -> None:
    def not_joined(url: str) -> list[str]:
        return [ln for ln in fleet.proxy_logs["colocated"].read_text().splitlines()
                if url in ln and "not joined" in ln]

    wait_for(lambda: not_joined(fleet.urls["dead"]) and not_joined(fleet.urls["other"]), 30.0,
             "both bad URLs logged as not joined", 0.1)
    dead, other = not_joined(fleet.urls["dead"]), not_joined(fleet.urls["other"])
    assert len(dead) == 1 and "Connection refused" in dead[0] and "still trying" in dead[0], dead
    # its server (c1) starts with the proxy: a first poll may find nothing listening yet, a
    # reason of its own, logged before the 404; each reason is logged once
    reasons = [ln.split(" has not joined: ", 1)[1] for ln in other]
    assert len(set(reasons)) == len(reasons) <= 2, other
    assert "/health" in other[-1] and "404" in other[-1], other
    health = httpx.get(fleet.urls["colocated"] + "/health", timeout=10).json()
    assert {u: w["alive"] for u, w in health["workers"].items()} == {
        fleet.urls["c1"]: True, fleet.urls["c2"]: True, fleet.urls["dead"]: False,
        fleet.urls["other"]: False}


def test_an_instance_serving_another_model_is_not_admitted(fleet: Fleet) -> None:
    async def join(model: str) -> Any:
        backend = VllmBackend({}, 10.0, model=model)
        try:
            return await backend.info(fleet.urls["c1"], 10.0)
        finally:
            await backend.aclose()

    info = asyncio.run(join(NAME))
    assert (info.role, info.model, info.block_size, info.model_hash) == \
        ("both", NAME, BLOCK, model_hash(NAME))
    assert info.kv_capacity_tokens == 256 * BLOCK
    with pytest.raises(InvalidArgument, match=r"serves \['emu'\], the cluster 'other'"):
        asyncio.run(join("other"))
