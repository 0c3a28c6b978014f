"""A prefill/decode pair of emulated vLLM instances (`kvpool worker --api vllm`, KV through the
pool as vLLM's store connector moves it) behind `kvpool proxy --backend vllm`: the prefill leg
with kv_transfer_params and max_tokens 1, the decode leg with what it returned; outputs
token-exact against the engine's, the decode instance's reuse of the stored blocks checked."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvpool.launch.children import spawn
from kvpool.launch.ports import free_port
from kvpool.launch.wait import wait_http
from tests.serve.vllm.conftest import (
    BLOCK,
    ENGINE_ARGS,
    NAME,
    Fleet,
    complete,
    native_expected,
    prompt,
    streamed,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fleet(emu_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    f = Fleet()
    try:
        rpc, admin = free_port(), free_port()
        f.procs.append(spawn("master", "--rpc-port", str(rpc), "--admin-port", str(admin),
                             "--metadata-port", str(free_port())))
        master = f"127.0.0.1:{rpc}"
        f.urls["p"], f.urls["d"] = (f"http://127.0.0.1:{free_port()}",
                                    f"http://127.0.0.1:{free_port()}")
        f.proxy("pd", emu_model, tmp_path_factory.mktemp("proxy") / "pd.log",
                "--prefill", f.urls["p"], "--decode", f.urls["d"])
        wait_http(f"http://127.0.0.1:{admin}/health", f.procs, "master")
        for name, role, extra in (("p", "prefill", ("--dram", "32MiB")), ("d", "decode", ())):
            port = f.urls[name].rsplit(":", 1)[1]
            f.procs.append(spawn("worker", "--model", str(emu_model), "--port", port,
                                 *ENGINE_ARGS, "--role", role, "--api", "vllm",
                                 "--served-model-name", NAME, "--master", master, *extra))
        f.urls["c1"] = f.urls["p"]  # native_expected reads the engine's identity there
        wait_http(f.urls["pd"] + "/health", f.procs, "the proxy", timeout_s=120)
        yield f
    finally:
        f.stop()


def test_a_prefill_decode_pair_through_the_pool(fleet: Fleet) -> None:
    url = fleet.urls["pd"]
    for i, length in enumerate((20, 257)):
        p = prompt(50 + i, length)
        r = complete(url, p, 8)
        assert r.status_code == 200, r.text
        assert r.json()["kvpool_trace"]["token_ids"] == native_expected(fleet, p, 8)
    # the decode instance loaded the full blocks the prefill instance stored, and says so
    p = prompt(60, 5 * BLOCK + 3)
    direct = {"model": NAME, "prompt": p, "max_tokens": 1, "temperature": 0,
              "kv_transfer_params": {"do_remote_decode": True}}
    pre = httpx.post(fleet.urls["p"] + "/v1/completions", json=direct, timeout=30).json()
    handoff = pre["kv_transfer_params"]
    assert handoff["do_remote_prefill"] is True and handoff["remote_request_id"]
    dec = httpx.post(fleet.urls["d"] + "/v1/completions", timeout=30, json=direct | {
        "max_tokens": 4, "ignore_eos": True, "kv_transfer_params": handoff}).json()
    assert dec["usage"]["prompt_tokens_details"]["cached_tokens"] == 5 * BLOCK
    assert dec["choices"][0]["token_ids"] == native_expected(fleet, p, 4)
    assert pre["choices"][0]["token_ids"] == native_expected(fleet, p, 1)


def test_streaming_and_what_the_backend_does_not_serve(fleet: Fleet) -> None:
    url = fleet.urls["pd"]
    p = prompt(70, 33)
    whole = complete(url, p, 6).json()
    assert whole["kvpool_trace"]["token_ids"] == native_expected(fleet, p, 6)
    assert streamed(url, p, 6) == (whole["choices"][0]["text"], 6)
    refused = complete(url, p, 2, echo=True, logprobs=1)
    assert refused.status_code == 400 and "prompt_logprobs" in refused.text


def test_streaming_over_the_pair(fleet: Fleet) -> None:
    url = fleet.urls["pd"]
    p = prompt(70, 33)
    whole = complete(url, p, 6).json()
    assert whole["kvpool_trace"]["token_ids"] == native_expected(fleet, p, 6)
    assert streamed(url, p, 6) == (whole["choices"][0]["text"], 6)
