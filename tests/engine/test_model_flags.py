"""--dtype auto, the default --max-model-len and --device, resolved over a model's config.json
as vLLM resolves them (kvpool.engine.model_flags)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from kvpool.engine.model_flags import (
    DEFAULT_MAX_MODEL_LEN,
    check_device,
    checked_flags,
    checkpoint_dtype,
    read_flags,
    resolve_flags,
)
from kvpool.errors import CheckpointError, ConfigError


def hf(**extra: Any) -> dict[str, Any]:
    return {"architectures": ["LlamaForCausalLM"], "vocab_size": 320, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "max_position_embeddings": 2048, **extra}


@pytest.mark.parametrize(("config", "want"), [
    ({"torch_dtype": "bfloat16"}, "bfloat16"), ({"dtype": "bfloat16"}, "bfloat16"),
    ({"torch_dtype": "torch.float16"}, "float16"), ({"torch_dtype": "float"}, "float32"),
    ({"torch_dtype": "float32", "dtype": "bfloat16"}, "float32"), ({}, None),
    ({"torch_dtype": "float64"}, None), ({"torch_dtype": 16}, None)])
def test_the_checkpoint_dtype_is_read_from_either_key(config: dict[str, Any],
                                                      want: str | None) -> None:
    assert checkpoint_dtype(config) == want


def test_auto_keeps_the_checkpoint_dtype_and_float16_widens_on_the_cpu() -> None:
    assert resolve_flags(hf(torch_dtype="bfloat16"), "auto", None, "cpu").dtype == "bfloat16"
    assert resolve_flags(hf(torch_dtype="float32"), "auto", None, "cpu").dtype == "float32"
    assert resolve_flags(hf(), "auto", None, "cpu").dtype == "float32"
    half = resolve_flags(hf(torch_dtype="float16"), "auto", None, "cpu")
    assert half.dtype == "float32" and "float16" in half.note and "--dtype float16" in half.note
    on_gpu = resolve_flags(hf(torch_dtype="float16"), "auto", None, "cuda:0")
    assert (on_gpu.dtype, on_gpu.note) == ("float16", "")
    given = resolve_flags(hf(torch_dtype="bfloat16"), "float16", None, "cpu")
    assert (given.dtype, given.note) == ("float16", "")
    with pytest.raises(ConfigError, match="--dtype must be one of auto, float32"):
        resolve_flags(hf(), "int8", None, "cpu")


def test_the_default_context_follows_the_model_up_to_the_cap() -> None:
    assert resolve_flags(hf(), "auto", None, "cpu").max_model_len == 2048
    long = resolve_flags(hf(max_position_embeddings=32768), "auto", None, "cpu")
    assert (long.max_model_len, long.context_len) == (DEFAULT_MAX_MODEL_LEN, 32768)
    assert resolve_flags(hf(), "auto", 2048, "cpu").max_model_len == 2048
    assert resolve_flags(hf(), "auto", 100, "cpu").max_model_len == 100


def test_a_context_above_the_models_is_refused_in_one_line() -> None:
    with pytest.raises(ConfigError) as exc:
        resolve_flags(hf(), "auto", 2049, "cpu", "/m/config.json")
    assert str(exc.value) == (
        "--max-model-len 2049 is greater than the model's context of 2048 tokens "
        "(max_position_embeddings=2048 in /m/config.json); give at most 2048, or leave it out")


def test_linear_rope_scaling_stretches_the_context() -> None:
    scaled = hf(rope_scaling={"rope_type": "linear", "factor": 2.0})
    assert resolve_flags(scaled, "auto", 4096, "cpu").context_len == 4096
    with pytest.raises(ConfigError, match=r"max_position_embeddings=2048 x rope_scaling factor"):
        resolve_flags(scaled, "auto", 4097, "cpu")


def test_read_flags_over_a_folder(tiny_llama: Path, tmp_path: Path) -> None:
    flags = read_flags(tiny_llama, "auto", None)
    assert (flags.dtype, flags.max_model_len) == ("float32", 2048)
    (tmp_path / "config.json").write_text(json.dumps(hf(num_attention_heads=3)))
    with pytest.raises(CheckpointError, match="config.json: hidden_size .64. must be a multiple"):
        read_flags(tmp_path, "auto", None)
    (tmp_path / "config.json").unlink()
    with pytest.raises(CheckpointError, match="needs config.json"):
        read_flags(tmp_path, "auto", None)


def test_a_device_torch_cannot_use_is_refused(tiny_llama: Path) -> None:
    check_device("cpu")
    for bad in ("gpu", "meta", *(() if torch.cuda.is_available() else ("cuda", "cuda:1"))):
        with pytest.raises(ConfigError, match=f"^--device {bad}: torch cannot use it here"):
            check_device(bad)
    assert checked_flags(tiny_llama, "auto", None, "gpu", "emulated").dtype == "float32"
    with pytest.raises(ConfigError, match="--device gpu"):
        checked_flags(tiny_llama, "auto", None, "gpu", "torch")
