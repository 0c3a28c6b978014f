"""The engine backend a proxy's settings name (serve/backend.py): `kvpool` workers or vLLM
servers. The one place that knows every backend."""

from __future__ import annotations

from kvpool.errors import ConfigError
from kvpool.serve.backend import EngineBackend
from kvpool.serve.config import ProxyConfig
from kvpool.serve.worker_client import WorkerClient


def create_backend(config: ProxyConfig) -> EngineBackend:
    if config.backend == "kvpool":
        return WorkerClient(config.worker_timeout_s, config.token,
                            merge_frames=config.merge_frames)
    if config.backend == "vllm":
        from kvpool.serve.vllm.backend import VllmBackend

        return VllmBackend.from_config(config)
    raise ConfigError(f"unknown engine backend {config.backend!r}")
