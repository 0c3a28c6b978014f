"""Tiny checkpoints shared by the engine tests (2 layers, hidden 64), built once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpool.engine.tiny import TinySpec, make_tiny


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("tiny-llama"), TinySpec(arch="llama", seed=1))


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("tiny-qwen2"),
                     TinySpec(arch="qwen2", seed=2, tie_word_embeddings=True))


@pytest.fixture(scope="session")
def tiny_llama3_rope(tmp_path_factory: pytest.TempPathFactory) -> Path:
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    return make_tiny(tmp_path_factory.mktemp("tiny-llama3"),
                     TinySpec(arch="llama", seed=3, num_kv_heads=1, rope_scaling=scaling))


@pytest.fixture(scope="session")
def tiny_linear_rope(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("tiny-linear"),
                     TinySpec(arch="llama", seed=4, rope_scaling={"rope_type": "linear",
                                                                  "factor": 2.0}))
