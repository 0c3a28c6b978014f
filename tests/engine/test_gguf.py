"""GGUF import: a GGUF file written here from a Hugging Face checkpoint (with llama.cpp's Q/K
row order, by its documented rule, and the checkpoint's own vocabulary and merges) imports
back to the same tensors, config, tokenizer and greedy tokens; bad input gets a clear error;
`--model` resolution. The real SmolLM2 file against transformers is in the slow job."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from kvpool.engine.checkpoint import CheckpointError, load_tokenizer, read_model_config
from kvpool.engine.config import EngineConfig, SamplingParams
from tests.support.require import require_module

gguf = require_module("gguf", "the engine extra (scripts/setup.sh)")

from kvpool.engine.gguf_checkpoint import cached_import, hf_name, import_gguf  # noqa: E402
from kvpool.serve.models import checked_folder, resolve_model  # noqa: E402
from tests.engine.gguf_factory import TEMPLATE, write_gguf  # noqa: E402


@pytest.fixture(scope="module")
def imported(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("gguf")
    return tiny_llama, import_gguf(write_gguf(tiny_llama, tmp / "tiny.gguf"), tmp / "hf")


def test_tensors_and_config_come_back(imported: tuple[Path, Path]) -> None:
    original, folder = imported
    want, got = load_file(str(original / "model.safetensors")), load_file(
        str(folder / "model.safetensors"))
    assert set(got) == set(want)
    for name, arr in want.items():
        np.testing.assert_array_equal(got[name], arr, err_msg=name)
    a, b = read_model_config(original), read_model_config(folder)
    assert (b.num_layers, b.num_heads, b.num_kv_heads, b.hidden_size, b.rms_norm_eps,
            b.rope_theta, b.tie_word_embeddings) == (a.num_layers, a.num_heads, a.num_kv_heads,
                                                     a.hidden_size, a.rms_norm_eps,
                                                     a.rope_theta, False)


def test_tokenizer_template_and_greedy_tokens_match(imported: tuple[Path, Path]) -> None:
    from kvpool.engine.llm_engine import LLMEngine

    original, folder = imported
    text = "the quick brown fox, 42 times"
    ours, theirs = load_tokenizer(folder), load_tokenizer(original)
    assert ours.encode(text) == theirs.encode(text) and ours.decode(ours.encode(text)) == text
    assert (folder / "chat_template.jinja").read_text() == TEMPLATE
    assert ours.chat_template == TEMPLATE
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    prompt = theirs.encode(text)
    want = LLMEngine.from_dir(original, EngineConfig(block_size=8)).generate([prompt], params)
    assert LLMEngine.from_dir(folder, EngineConfig(block_size=8)).generate([prompt], params) == want


def test_bad_files_get_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="not found"):
        import_gguf(tmp_path / "nope.gguf", tmp_path / "out")
    for call in (lambda: import_gguf(tmp_path, tmp_path / "out"), lambda: cached_import(tmp_path)):
        with pytest.raises(CheckpointError, match="is a folder; this takes one GGUF file.*needs "
                                                  "no import: give it to --model"):
            call()
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf at all" * 10)
    with pytest.raises(CheckpointError, match="not a GGUF file"):
        import_gguf(junk, tmp_path / "out")
    with pytest.raises(CheckpointError, match="unknown GGUF tensor"):
        hf_name("blk.0.attn_qkv.weight")
    assert hf_name("blk.7.ffn_down.weight") == "model.layers.7.mlp.down_proj.weight"


def test_model_resolution(imported: tuple[Path, Path], tmp_path: Path,
                          monkeypatch: pytest.MonkeyPatch) -> None:
    original, folder = imported
    monkeypatch.setenv("KVPOOL_MODEL_CACHE", str(tmp_path / "cache"))
    src = write_gguf(original, tmp_path / "m.gguf")
    steps: list[tuple[int, int]] = []
    first = resolve_model(str(src), lambda done, total: steps.append((done, total)))
    assert first.parent == tmp_path / "cache" and (first / "kvpool_gguf.json").is_file()
    total = len(load_file(str(folder / "model.safetensors"))) + 1  # each tensor, the write
    assert steps == [(i, total) for i in range(total + 1)]  # from 0, before any tensor
    steps.clear()
    assert cached_import(src, lambda done, total: steps.append((done, total))) == first
    assert steps == []  # imported once
    assert checked_folder(folder) == folder
    with pytest.raises(CheckpointError, match="no such file"):
        resolve_model(str(tmp_path / "missing"))
    holder = tmp_path / "holder"
    holder.mkdir()
    (holder / "x.gguf").write_bytes(src.read_bytes())
    with pytest.raises(CheckpointError, match="holds a GGUF file"):
        resolve_model(str(holder))
    with pytest.raises(CheckpointError, match="tokenizer.json not found"):
        (tmp_path / "half").mkdir()
        (tmp_path / "half" / "config.json").write_text("{}")
        resolve_model(str(tmp_path / "half"))


def test_a_gguf_rewritten_in_place_is_imported_again(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Same name, size and mtime (to the second), other weights: another import and another
    KV identity."""
    import os

    from kvpool.engine.identity import identity_for_dir
    from kvpool.engine.tiny import TinySpec, make_tiny

    monkeypatch.setenv("KVPOOL_MODEL_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "m.gguf"
    write_gguf(make_tiny(tmp_path / "s0", TinySpec(seed=0)), path)
    st = path.stat()
    first = cached_import(path)
    write_gguf(make_tiny(tmp_path / "s7", TinySpec(seed=7)), path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    assert path.stat().st_size == st.st_size
    second = cached_import(path)
    assert second != first and cached_import(path) == second
    roots = {identity_for_dir(f, EngineConfig()).root for f in (first, second)}
    assert len(roots) == 2
