"""A prefill/decode pair of emulated vLLM instances (`kvpool worker --api vllm`, KV through the
pool as vLLM's store connector moves it) behind `kvpool proxy --backend vllm`: the prefill leg
with kv_transfer_params and max_tokens 1, the decode leg with what it returned; outputs
token-exact against the engine's, the decode instance's reuse of the stored blocks checked.
The same pair driven as vLLM's MooncakeConnector (`--kv-transfer mooncake`: one transfer id on
both legs, the prefill engine's id from its bootstrap /query), which the face enforces
(engine/worker/vllm_p2p.py); a bootstrap that does not answer keeps the instance out, logged."""

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
from tests.support.wait import wait_for

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
        logs = tmp_path_factory.mktemp("proxy")
        f.proxy("pd", emu_model, logs / "pd.log", "--prefill", f.urls["p"], "--decode", f.urls["d"])
        f.proxy("p2p", emu_model, logs / "p2p.log", "--prefill", f.urls["p"], "--decode",
                f.urls["d"], "--kv-transfer", "mooncake", "--mooncake-bootstrap",
                f"{f.urls['p']}={f.urls['p']}")
        f.proxy("nop2p", emu_model, logs / "nop2p.log", "--prefill", f.urls["p"], "--decode",
                f.urls["d"], "--kv-transfer", "mooncake", "--mooncake-bootstrap",
                f"{f.urls['p']}=http://127.0.0.1:{free_port()}")
        wait_http(f"http://127.0.0.1:{admin}/health", f.procs, "master")
        for name, role, extra in (("p", "prefill", ("--dram", "32MiB")), ("d", "decode", ())):
            port = f.urls[name].rsplit(":", 1)[1]
            f.procs.append(spawn("worker", "--model", str(emu_model), "--port", port,
                                 *ENGINE_ARGS, "--role", role, "--api", "vllm",
                                 "--served-model-name", NAME, "--master", master, *extra))
        f.urls["c1"] = f.urls["p"]  # native_expected reads the engine's identity there
        for name in ("pd", "p2p"):
            wait_http(f.urls[name] + "/health", f.procs, "the proxy", timeout_s=120)
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


def test_the_mooncake_connector_protocol(fleet: Fleet) -> None:
    url = fleet.urls["p2p"]
    for i, length in enumerate((20, 5 * BLOCK + 3)):
        p = prompt(80 + i, length)
        r = complete(url, p, 8)
        assert r.status_code == 200, fleet.proxy_logs["p2p"].read_text()[-3000:]
        assert r.json()["kvpool_trace"]["token_ids"] == native_expected(fleet, p, 8)
    assert streamed(url, prompt(82, 40), 5)[1] == 5
    # what the face enforces: one pull per transfer id, from the engine that holds it
    p = prompt(83, 40)
    body = {"model": NAME, "prompt": p, "max_tokens": 1, "temperature": 0,
            "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False,
                                   "transfer_id": "t-83"}}
    pre = httpx.post(fleet.urls["p"] + "/v1/completions", json=body, timeout=30).json()
    assert pre["kv_transfer_params"] is None  # as vLLM's MooncakeConnector: the proxy knows
    engine = httpx.get(fleet.urls["p"] + "/query", timeout=10).json()["0"]["engine_id"]
    decode = body | {"max_tokens": 3, "ignore_eos": True, "kv_transfer_params": {
        "do_remote_prefill": True, "remote_engine_id": engine, "transfer_id": "t-83",
        "remote_bootstrap_addr": fleet.urls["p"]}}
    d = httpx.post(fleet.urls["d"] + "/v1/completions", json=decode, timeout=30)
    assert d.json()["choices"][0]["token_ids"] == native_expected(fleet, p, 3)
    again = httpx.post(fleet.urls["d"] + "/v1/completions", json=decode, timeout=30)
    assert again.status_code == 500 and "holds no such transfer" in again.text
    other = decode | {"kv_transfer_params": decode["kv_transfer_params"] | {
        "remote_engine_id": "not-it"}}
    wrong = httpx.post(fleet.urls["d"] + "/v1/completions", json=other, timeout=30)
    assert wrong.status_code == 500 and "knows no engine 'not-it'" in wrong.text
    short = decode | {"kv_transfer_params": {"do_remote_prefill": True, "transfer_id": "t"}}
    bad = httpx.post(fleet.urls["d"] + "/v1/completions", json=short, timeout=30)
    assert bad.status_code == 400 and "remote_engine_id, remote_bootstrap_addr" in bad.text


def test_a_prefill_instance_without_a_bootstrap_server_is_kept_out(fleet: Fleet) -> None:
    log = fleet.proxy_logs["nop2p"]
    wait_for(lambda: "Mooncake bootstrap server" in log.read_text(), timeout_s=30,
             what="the proxy's log line")
    assert "does not answer" in log.read_text()
    r = complete(fleet.urls["nop2p"], prompt(90, 20), 2)
    assert r.status_code == 503, r.text
