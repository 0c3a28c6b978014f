"""kvpool.engine: the reference inference engine (torch) and its prefill/decode workers.

`blocks` (prefix hashes and pool keys) needs only numpy; everything else imports torch, so the
names below are loaded on first use.
"""

from __future__ import annotations

from typing import Any

_LAZY = {
    "LLMEngine": "kvpool.engine.llm_engine",
    "StepOutput": "kvpool.engine.llm_engine",
    "EngineConfig": "kvpool.engine.config",
    "ModelConfig": "kvpool.engine.config",
    "SamplingParams": "kvpool.engine.config",
    "load_model": "kvpool.engine.checkpoint",
    "load_tokenizer": "kvpool.engine.checkpoint",
    "CheckpointError": "kvpool.engine.checkpoint",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvpool.engine' has no attribute {name!r}")
