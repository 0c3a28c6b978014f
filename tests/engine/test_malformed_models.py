"""Model files are input: every malformed config, weight index, tokenizer and GGUF file is one
CheckpointError naming the field or the fault, from the start-up check, the worker's load path
and the GGUF import alike, before anything is built or written."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from kvpool.engine.checkpoint import check_checkpoint, load_model, read_model_config
from kvpool.errors import CheckpointError
from kvpool.serve.tokenizer import ModelTokenizer
from tests.engine.malformed import FOLDER_CASES, GGUF_CASES, edited_config
from tests.support.require import require_module

gguf = require_module("gguf", "the engine extra (scripts/setup.sh)")

from kvpool.engine.gguf_checkpoint import cached_import, import_gguf  # noqa: E402
from tests.engine.gguf_factory import write_gguf  # noqa: E402


@pytest.fixture(scope="module")
def good_gguf(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> bytes:
    return write_gguf(tiny_llama, tmp_path_factory.mktemp("gguf") / "tiny.gguf").read_bytes()


@pytest.mark.parametrize("case", list(FOLDER_CASES))
def test_a_malformed_folder_is_refused_by_the_check_and_the_load(case: str, tiny_llama: Path,
                                                                  tmp_path: Path) -> None:
    make, words = FOLDER_CASES[case]
    bad = make(tiny_llama, tmp_path / "m")
    with pytest.raises(CheckpointError, match=words):
        check_checkpoint(bad)  # kvpool up's start-up check
    if "tokenizer" in case:
        with pytest.raises(CheckpointError, match=words):
            ModelTokenizer(bad)  # the proxy's load
    else:
        with pytest.raises(CheckpointError, match=words):
            load_model(bad)  # the worker's load


@pytest.mark.parametrize("case", list(GGUF_CASES))
def test_a_malformed_gguf_is_refused_before_anything_is_written(case: str, good_gguf: bytes,
                                                                tmp_path: Path) -> None:
    mutate, words = GGUF_CASES[case]
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(mutate(good_gguf))
    with pytest.raises(CheckpointError, match=words) as info:
        import_gguf(bad, tmp_path / "out")
    assert str(info.value).startswith(str(bad)) and "\n" not in str(info.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("meta", "words"), [
    ({"num_attention_heads": 0}, "num_attention_heads must be in 1..1024, got 0"),
    ({"num_hidden_layers": 3_000_000}, "num_hidden_layers must be in 1..1024, got 3000000"),
    ({"num_key_value_heads": 3}, r"num_attention_heads \(4\) must be a multiple of "
                                 r"num_key_value_heads \(3\)"),
    ({"merges": ["nospace"]}, "tokenizer.ggml.merges holds an entry without a space"),
    ({"bos_token_id": 99999}, "bos_token_id is 99999, not a token of the 512"),
    ({"chat_template": "{% for m in %}"}, "the chat template does not parse"),
])
def test_gguf_metadata_is_bounded_like_a_config(meta: dict, words: str, tiny_llama: Path,
                                                tmp_path: Path) -> None:
    bad = write_gguf(tiny_llama, tmp_path / "bad.gguf", **meta)
    with pytest.raises(CheckpointError, match=words):
        import_gguf(bad, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_gguf_tensor_shapes_are_checked_against_the_metadata(tiny_llama: Path,
                                                             tmp_path: Path) -> None:
    bad = write_gguf(tiny_llama, tmp_path / "bad.gguf", intermediate_size=100)
    with pytest.raises(CheckpointError, match=r"'blk.0.ffn_down.weight' has shape \(64, 128\), "
                                              r"the metadata needs \(64, 100\)"):
        import_gguf(bad, tmp_path / "out")


def test_every_bound_is_checked(tiny_llama: Path, tmp_path: Path) -> None:
    cases = {"hidden_size": 65540, "intermediate_size": (1 << 20) + 1, "head_dim": 2048,
             "max_position_embeddings": (1 << 24) + 1, "num_key_value_heads": 0,
             "rope_theta": -1.0, "rms_norm_eps": 2.0, "eos_token_id": "x", "vocab_size": 1.5}
    for i, (field, value) in enumerate(cases.items()):
        bad = edited_config(tiny_llama, tmp_path / f"m{i}", **{field: value})
        with pytest.raises(CheckpointError, match=f"{field} must be"):
            read_model_config(bad)
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    with pytest.raises(CheckpointError, match="high_freq_factor must be above low_freq_factor"):
        read_model_config(edited_config(tiny_llama, tmp_path / "r", rope_scaling=llama3))


def test_malformed_json_files_are_named(tiny_llama: Path, tmp_path: Path) -> None:
    for i, name in enumerate(("config.json", "generation_config.json", "tokenizer_config.json",
                              "model.safetensors.index.json")):
        bad = tmp_path / f"m{i}"
        shutil.copytree(tiny_llama, bad)
        (bad / name).write_text('{"a": [1, 2')
        with pytest.raises(CheckpointError, match=f"{name}: not a readable JSON file"):
            check_checkpoint(bad)
    listed = edited_config(tiny_llama, tmp_path / "list", eos_token_id=1)
    (listed / "config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="config.json must hold a JSON object, got list"):
        check_checkpoint(listed)
    no_map = tmp_path / "no_map"
    shutil.copytree(tiny_llama, no_map)
    (no_map / "model.safetensors.index.json").write_text('{"weight_map": []}')
    with pytest.raises(CheckpointError, match='needs a non-empty "weight_map" object'):
        check_checkpoint(no_map)
    template = tmp_path / "template"
    shutil.copytree(tiny_llama, template)
    (template / "chat_template.jinja").write_text("{% if %}")
    for load in (check_checkpoint, ModelTokenizer):
        with pytest.raises(CheckpointError, match="the chat template does not parse"):
            load(template)


def test_a_hub_snapshot_with_links_into_its_blobs_loads(tiny_llama: Path, tmp_path: Path) -> None:
    """The one confinement exception: a hub cache's snapshot links into the repo's blobs."""
    repo = tmp_path / "models--org--tiny"
    snapshot, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    weights = load_file(str(tiny_llama / "model.safetensors"))
    names = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in shards.items():
        save_file({k: weights[k] for k in keys}, str(blobs / f"blob-{file}"))
        os.symlink(f"../../blobs/blob-{file}", snapshot / file)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_llama / name, blobs / name)
        os.symlink(f"../../blobs/{name}", snapshot / name)
    index = {"weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (snapshot / "model.safetensors.index.json").write_text(json.dumps(index))
    check_checkpoint(snapshot)
    assert load_model(snapshot).config.num_layers == 2


def test_a_bad_gguf_given_as_model_leaves_nothing_in_the_cache(good_gguf: bytes, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch
                                                              ) -> None:
    monkeypatch.setenv("KVPOOL_MODEL_CACHE", str(tmp_path / "cache"))
    mutate, words = GGUF_CASES["gguf: unsupported type"]
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(mutate(good_gguf))
    with pytest.raises(CheckpointError, match=words):
        cached_import(bad)
    cache = tmp_path / "cache"
    assert not cache.exists() or list(cache.iterdir()) == []
