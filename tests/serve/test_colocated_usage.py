"""A colocated worker (`kvpool up --colocated 1`): the prompt's reuse reaches the usage of a
request whose stream the proxy ends itself at a stop string (it never reads the worker's
finish line, which says the reuse too)."""

from __future__ import annotations

import uuid
from pathlib import Path

import httpx

from kvpool.launch.ports import free_port
from tests.serve.conftest import kvpool_up, reap, wait_ready


def test_a_stream_cut_at_a_stop_string_reports_the_prompts_reuse(cache_home: Path,
                                                                  tmp_path: Path) -> None:
    marker, port = f"up-{uuid.uuid4().hex}", free_port()
    log = tmp_path / "up.log"
    with log.open("w") as out:
        proc = kvpool_up(marker, cache_home, "--port", str(port), "--prefill", "0",
                         "--decode", "0", "--colocated", "1", "--no-token", stdout=out)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(proc, url, log)
        prompt = "the pool keeps every block of the cache " * 6
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 40, "temperature": 0,
                "ignore_eos": True}
        text = httpx.post(url + "/v1/completions", json=body, timeout=60).json()[
            "choices"][0]["text"]                        # (warms the worker's cache)
        whole = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
        cached = whole["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached > 0
        stop = text[20:24]
        cut = httpx.post(url + "/v1/completions", json={**body, "stop": [stop]},
                         timeout=60).json()
        assert cut["choices"][0]["finish_reason"] == "stop"
        assert cut["usage"]["prompt_tokens_details"]["cached_tokens"] == cached
    finally:
        reap(proc, marker)
