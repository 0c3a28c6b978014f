"""Strict checkpoint loading: a bad folder gets an error that names what is wrong."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvpool.engine.checkpoint import (
    CheckpointError,
    check_checkpoint,
    load_model,
    load_tokenizer,
)
from kvpool.engine.tiny import TinySpec, make_tiny
from kvpool.errors import KvpoolError
from tests.engine.helpers import full_logits


def edit_weights(src: Path, dst: Path, edit) -> Path:  # type: ignore[no-untyped-def]
    shutil.copytree(src, dst)
    weights = load_file(str(dst / "model.safetensors"))
    edit(weights)
    save_file(weights, str(dst / "model.safetensors"))
    return dst


def test_missing_tensor_is_named(tiny_llama: Path, tmp_path: Path) -> None:
    bad = edit_weights(tiny_llama, tmp_path / "m",
                       lambda w: w.pop("model.layers.1.mlp.up_proj.weight"))
    for load in (load_model, check_checkpoint):  # the start-up check finds it too
        with pytest.raises(CheckpointError, match=r"missing tensor 'model.layers.1.mlp.up_proj.weight'"):
            load(bad)


def test_unexpected_tensor_is_named(tiny_llama: Path, tmp_path: Path) -> None:
    bad = edit_weights(tiny_llama, tmp_path / "m",
                       lambda w: w.__setitem__("model.layers.9.extra", torch.zeros(2)))
    for load in (load_model, check_checkpoint):  # the start-up check finds it too
        with pytest.raises(CheckpointError, match=r"unexpected tensor 'model.layers.9.extra'"):
            load(bad)


def test_wrong_shape_is_named(tiny_llama: Path, tmp_path: Path) -> None:
    bad = edit_weights(tiny_llama, tmp_path / "m",
                       lambda w: w.__setitem__("model.norm.weight", torch.ones(63)))
    for load in (load_model, check_checkpoint):  # the start-up check finds it too
        with pytest.raises(CheckpointError, match=r"'model.norm.weight'.*\(63,\).*\(64,\)"):
            load(bad)


def test_unknown_architecture(tiny_llama: Path, tmp_path: Path) -> None:
    bad = tmp_path / "m"
    shutil.copytree(tiny_llama, bad)
    config = json.loads((bad / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(KvpoolError, match="unknown architecture.*GPT2LMHeadModel"):
        load_model(bad)


def test_sharded_checkpoint_loads_the_same(tiny_llama: Path, tmp_path: Path) -> None:
    sharded = tmp_path / "sharded"
    shutil.copytree(tiny_llama, sharded)
    weights = load_file(str(sharded / "model.safetensors"))
    (sharded / "model.safetensors").unlink()
    names = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in shards.items():
        save_file({k: weights[k] for k in keys}, str(sharded / file))
    index = {"weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    ids = [3, 4, 5, 6, 7]
    assert torch.equal(full_logits(load_model(sharded), ids), full_logits(load_model(tiny_llama), ids))


def test_make_tiny_is_deterministic(tmp_path: Path) -> None:
    a = make_tiny(tmp_path / "a", TinySpec(seed=7))
    b = make_tiny(tmp_path / "b", TinySpec(seed=7))
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_tokenizer_round_trip_and_chat_template(tiny_llama: Path) -> None:
    tok = load_tokenizer(tiny_llama)
    ids = tok.encode("hello world, the cache is fast")
    assert tok.decode(ids) == "hello world, the cache is fast"
    assert tok.eos_token_ids == (1,) and tok.bos_token_id == 0
    text = tok.render_chat([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_derived_tensors_are_ignored_and_generation_eos_is_read(tiny_llama: Path,
                                                               tmp_path: Path) -> None:
    old = edit_weights(tiny_llama, tmp_path / "m", lambda w: w.__setitem__(
        "model.layers.0.self_attn.rotary_emb.inv_freq", torch.ones(8)))
    (old / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 3]}))
    model = load_model(old)
    assert model.config.eos_token_ids == (1, 3)


def test_lazy_package_names() -> None:
    import kvpool.engine as engine
    assert engine.LLMEngine.__name__ == "LLMEngine" and engine.SamplingParams().max_tokens == 16


def test_start_up_check_reads_no_weight_but_finds_what_loading_would(tiny_llama: Path,
                                                                     tmp_path: Path) -> None:
    check_checkpoint(tiny_llama)  # a good folder passes
    torn = tmp_path / "torn"
    shutil.copytree(tiny_llama, torn)
    data = (torn / "model.safetensors").read_bytes()
    (torn / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        check_checkpoint(torn)
    no_tok = tmp_path / "no_tok"
    shutil.copytree(tiny_llama, no_tok)
    (no_tok / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="tokenizer.json not found"):
        check_checkpoint(no_tok)
    no_weights = tmp_path / "no_weights"
    shutil.copytree(tiny_llama, no_weights)
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        check_checkpoint(no_weights)
