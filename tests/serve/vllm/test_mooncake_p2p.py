"""serve/vllm/mooncake_p2p.py: the kv_transfer_params the proxy gives each leg under
`--kv-transfer mooncake`, and the engine id it reads from a bootstrap server's /query."""

from __future__ import annotations

import pytest

from kvpool.errors import ConfigError, InvalidArgument
from kvpool.serve.config import ProxyConfig
from kvpool.serve.vllm.mooncake_p2p import MooncakeP2P, engine_id_of, new_transfer_id


def test_both_legs_name_one_transfer_and_the_prefill_engine() -> None:
    p2p = MooncakeP2P({"http://p2:8000": "http://10.0.0.9:9000/"})
    assert p2p.bootstrap("http://127.0.0.5:8100") == "http://127.0.0.5:8998"  # vLLM's default
    assert p2p.bootstrap("http://p2:8000") == "http://10.0.0.9:9000"
    p2p.learn("http://127.0.0.5:8100", {"0": {"engine_id": "eng-a", "worker_addr": {}}})
    tid = new_transfer_id()
    assert p2p.prefill_params(tid) == {"do_remote_decode": True, "do_remote_prefill": False,
                                       "transfer_id": tid}
    assert p2p.decode_params("http://127.0.0.5:8100", tid) == {
        "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "eng-a",
        "remote_bootstrap_addr": "http://127.0.0.5:8998", "transfer_id": tid}
    assert new_transfer_id() != tid
    with pytest.raises(InvalidArgument, match="no Mooncake engine id"):
        p2p.decode_params("http://p2:8000", tid)


@pytest.mark.parametrize(("query", "why"), [
    ({}, "names no engine"), ([], "names no engine"),
    ({"0": {"engine_id": "a"}, "1": {"engine_id": "b"}}, "2 data-parallel ranks"),
    ({"0": {"worker_addr": {}}}, "no engine_id"), ({"0": "x"}, "no engine_id")])
def test_an_unusable_query_reply_says_why(query: object, why: str) -> None:
    with pytest.raises(InvalidArgument, match=why):
        engine_id_of(query)


def test_mooncake_needs_the_vllm_backend() -> None:
    with pytest.raises(ConfigError, match="needs the vllm backend"):
        ProxyConfig("m", kv_transfer="mooncake")
    assert ProxyConfig("m", backend="vllm", kv_transfer="mooncake").kv_transfer == "mooncake"
