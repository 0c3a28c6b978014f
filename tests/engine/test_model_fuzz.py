"""Fuzz of the model loaders: random mutations of a valid config.json and random mutations and
truncations of a valid tiny GGUF file either load or raise the project's error (ConfigError, of
which CheckpointError is one), never another exception, and each example is fast."""

from __future__ import annotations

import json
import random
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpool.engine.checkpoint import read_model_config
from kvpool.engine.config import MODEL_LIMITS, ModelConfig
from kvpool.engine.gguf_header import parse_header
from kvpool.engine.tiny import TinySpec, hf_config
from kvpool.errors import CheckpointError, ConfigError
from tests.support.require import require_module

gguf = require_module("gguf", "the engine extra (scripts/setup.sh)")

from kvpool.engine.gguf_checkpoint import import_gguf  # noqa: E402
from tests.engine.gguf_factory import write_gguf  # noqa: E402

SETTINGS = settings(deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow])
VALUES = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70),
                   st.integers(-3, 70), st.floats(allow_nan=True, allow_infinity=True),
                   st.text(max_size=4), st.lists(st.integers(-2, 5), max_size=3),
                   st.dictionaries(st.sampled_from(["rope_type", "type", "factor",
                                                    "low_freq_factor", "high_freq_factor",
                                                    "original_max_position_embeddings"]),
                                   st.one_of(st.sampled_from(["linear", "llama3", "yarn"]),
                                             st.floats(-2, 2000), st.integers(-1, 10)),
                                   max_size=6))
KEYS = sorted(hf_config(TinySpec()) | {"head_dim": 16, "rope_scaling": None,
                                       "rope_parameters": None})


@settings(SETTINGS, max_examples=120)
@given(st.dictionaries(st.sampled_from(KEYS), VALUES, max_size=4))
def test_a_mutated_config_loads_within_bounds_or_is_a_config_error(changes: dict) -> None:
    hf = hf_config(TinySpec()) | changes
    try:
        config = ModelConfig.from_hf(hf)
    except ConfigError:
        return
    assert 1 <= config.num_layers <= MODEL_LIMITS.max_layers
    assert 1 <= config.vocab_size <= MODEL_LIMITS.max_vocab_size
    assert config.num_heads % config.num_kv_heads == 0 and config.head_dim % 2 == 0


@settings(SETTINGS, max_examples=30)
@given(st.binary(max_size=64) | st.sampled_from([b"[]", b"null", b'{"a": 1}', b"[" * 100000]))
def test_config_json_bytes_load_or_are_a_checkpoint_error(data: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_bytes(data)
        with pytest.raises(CheckpointError):
            read_model_config(tmp)


@pytest.fixture(scope="module")
def good_gguf(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> bytes:
    return write_gguf(tiny_llama, tmp_path_factory.mktemp("fuzz") / "tiny.gguf").read_bytes()


def header_size(data: bytes) -> int:
    return parse_header(data, len(data)).data_start


def mutated(data: bytes, rng: random.Random, cut: int | None) -> bytes:
    """1 to 4 overwrites of 1, 4 or 8 bytes in the header (half of them among the tensor infos
    at its end) with a small or a random value; then the first `cut` bytes."""
    out = bytearray(data)
    end = header_size(data)
    for _ in range(rng.randint(1, 4)):
        width = rng.choice([1, 4, 8])
        at = end - rng.randint(width, 2400) if rng.random() < 0.5 else rng.randrange(end - width)
        value = rng.randrange(300) if rng.random() < 0.5 else rng.getrandbits(8 * width)
        out[at:at + width] = (value % (1 << (8 * width))).to_bytes(width, "little")
    return bytes(out if cut is None else out[:cut % (len(out) + 1)])


MUTATION = {"rng": st.randoms(use_true_random=False), "cut": st.none() | st.integers(0, 1 << 20)}


@settings(SETTINGS, max_examples=150)
@given(**MUTATION)
def test_a_mutated_gguf_header_parses_or_is_a_checkpoint_error(good_gguf: bytes,
                                                               rng: random.Random,
                                                               cut: int | None) -> None:
    data = mutated(good_gguf, rng, cut)
    try:
        header = parse_header(data, len(data))
    except CheckpointError:
        return
    assert all(header.data_start + t.offset + t.num_bytes <= len(data) for t in header.tensors)


@settings(SETTINGS, max_examples=15)
@given(**MUTATION)
def test_a_mutated_gguf_imports_or_is_a_checkpoint_error(good_gguf: bytes, rng: random.Random,
                                                         cut: int | None) -> None:
    data = mutated(good_gguf, rng, cut)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "m.gguf"
        path.write_bytes(data)
        try:
            out = import_gguf(path, Path(tmp) / "out")
        except CheckpointError:
            assert not (Path(tmp) / "out").exists()
            return
        config: Any = json.loads((out / "config.json").read_text())
        assert ModelConfig.from_hf(config).num_layers == 2
