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
        assert backend.features.migration and not backend.features.first_token_from_prefill
    finally:
        asyncio.run(backend.aclose())


def test_push_and_unknown_backends_are_refused() -> None:
    with pytest.raises(ConfigError, match="push needs kvpool workers"):
        ProxyConfig(model_dir="m", backend="vllm", kv_transfer="push")
    with pytest.raises(ConfigError, match="backend must be one of"):
        ProxyConfig(model_dir="m", backend="sglang")
    with pytest.raises(ConfigError, match="direct_below_tokens"):
        ProxyConfig(model_dir="m", direct_below_tokens=-1)
    with pytest.raises(ConfigError, match="whole_interval must be in 0..1024, got 1025"):
        ProxyConfig(model_dir="m", whole_interval=1025)
    with pytest.raises(ConfigError, match="whole_interval"):
        ProxyConfig(model_dir="m", whole_interval=-1)


def test_a_resumed_decode_leg_sends_the_output_as_prompt_or_is_refused() -> None:
    from kvpool.engine.worker.messages import GenerateRequest
    from kvpool.errors import WorkerCallError

    backend = VllmBackend({}, 1.0, model="m")
    try:
        s = SamplingParams(max_tokens=10, min_tokens=3)
        req = GenerateRequest(request_id="r", prompt_token_ids=[1, 2], sampling=s,
                              resume_output_ids=[7, 8, 9])
        body = backend._generate_body("http://x:1", req)
        assert (body["prompt"], body["max_tokens"], body["min_tokens"]) == ([1, 2, 7, 8, 9], 7, 0)
        for bad in (SamplingParams(max_tokens=10, presence_penalty=0.5),
                    SamplingParams(max_tokens=10, min_tokens=5),
                    SamplingParams(max_tokens=10, temperature=0.7, seed=3)):
            with pytest.raises(WorkerCallError) as exc:
                backend._generate_body("http://x:1", req.model_copy(update={"sampling": bad}))
            assert exc.value.status == 400
    finally:
        asyncio.run(backend.aclose())
