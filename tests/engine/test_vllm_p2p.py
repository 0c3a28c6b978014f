"""engine/worker/vllm_p2p.py: what the vLLM face holds for a Mooncake transfer id, and what a
decode request must name (sans-I/O parts; the protocol end to end is in
tests/serve/vllm/test_backend_pd_live.py)."""

from __future__ import annotations

import pytest

from kvpool.clock import VirtualClock
from kvpool.engine.worker.vllm_p2p import HeldTransfers, bootstrap_query, decode_fields


def test_a_transfer_is_taken_once_and_expires() -> None:
    clock = VirtualClock()
    held = HeldTransfers(clock, ttl_s=10.0)
    held.hold("t1", 300)
    held.hold("t2", 40)
    with pytest.raises(ValueError, match="already held"):
        held.hold("t1", 5)
    assert held.take("t1") == 300
    assert held.take("t1") is None  # once
    clock.advance(10.0)
    assert held.take("t2") is None and len(held) == 0  # ttl over: freed


def test_decode_fields_name_what_is_missing() -> None:
    kv = {"do_remote_prefill": True, "remote_engine_id": "e", "transfer_id": "t",
          "remote_bootstrap_addr": "http://h:8998/"}
    assert decode_fields(kv) == ("e", "http://h:8998", "t")
    with pytest.raises(ValueError, match="remote_bootstrap_addr, transfer_id"):
        decode_fields({"remote_engine_id": "e", "transfer_id": ""})


def test_the_query_reply_has_vllms_shape() -> None:
    assert bootstrap_query("e", "h:1") == {
        "0": {"engine_id": "e", "worker_addr": {"0": {"0": "h:1"}}}}
