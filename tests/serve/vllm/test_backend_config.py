"""The vllm backend's settings: roles from the flags, what it does not serve, the refusals."""

from __future__ import annotations

import asyncio

import pytest

from kvpool.engine.config import SamplingParams
from kvpool.errors import ConfigError
from kvpool.serve.config import ProxyConfig
from kvpool.serve.vllm.backend import VllmBackend


def test_roles_come_from_the_flags() -> None:
    config = ProxyConfig(model_dir="m", backend="vllm", prefill_urls=("http://p:1/",),
                         decode_urls=("http://d:1",), colocated_urls=("http://c:1",),
                         engine_model="served")
    backend = VllmBackend.from_config(config)
    try:
        assert backend.roles == {"http://p:1": "prefill", "http://d:1": "decode",
                                 "http://c:1": "both"}
        assert backend.model == "served" and backend.events is None
        assert backend.prefixes(["http://p:1"]) is None and backend.engine_gauges() == {}
        assert backend.unsupported(SamplingParams(prompt_logprobs=1)) == "prompt_logprobs"
        assert backend.unsupported(SamplingParams(logprobs=1)) is None
        assert not backend.features.migration and not backend.features.first_token_from_prefill
    finally:
        asyncio.run(backend.aclose())


def test_push_and_unknown_backends_are_refused() -> None:
    with pytest.raises(ConfigError, match="push needs kvpool workers"):
        ProxyConfig(model_dir="m", backend="vllm", kv_transfer="push")
    with pytest.raises(ConfigError, match="backend must be one of"):
        ProxyConfig(model_dir="m", backend="sglang")
    with pytest.raises(ConfigError, match="direct_below_tokens"):
        ProxyConfig(model_dir="m", direct_below_tokens=-1)
