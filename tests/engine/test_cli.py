"""The engine's commands, run in-process through the `kvpool` entry point."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kvpool.cli.main import main
from kvpool.engine.checkpoint import load_model


def test_make_tiny(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["model", "make-tiny", str(tmp_path / "m"), "--arch", "qwen2", "--layers", "1",
                 "--hidden", "32", "--heads", "2", "--kv-heads", "1", "--vocab", "320"]) == 0
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"] and config["num_hidden_layers"] == 1
    assert load_model(tmp_path / "m").config.vocab_size == 320


def test_bench_engine_smoke(tiny_llama: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "engine", "--model", str(tiny_llama), "--batches", "2",
                 "--prompt-len", "8", "--decode-steps", "2", "--no-ttft", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert {(r["impl"], r["phase"]) for r in rows} == {
        ("kvpool", "prefill batch 2 mixed"), ("kvpool", "decode batch 2 mixed"),
        ("transformers", "prefill batch 2 mixed"), ("transformers", "decode batch 2 mixed"),
        ("kvpool", "generate 6 requests, 2 at a time"),
        ("transformers", "generate 6 requests, 2 at a time")}
    assert all(r["value"] > 0 for r in rows)


def test_generate_chat_without_a_template_is_one_line(tiny_llama: Path, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    import shutil
    folder = tmp_path / "no-template"
    shutil.copytree(tiny_llama, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert main(["generate", "hi", "--chat", "--model", str(folder), "--max-tokens", "2"]) == 1
    err = capsys.readouterr().err
    assert err.splitlines() == ["kvpool generate: this tokenizer has no chat_template; drop "
                                "--chat to send the prompt as it is"]


def test_generate_in_process(tiny_llama: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "hello world", "--model", str(tiny_llama), "--max-tokens", "5"]) == 0
    count = re.search(r"\[(\d+) tokens\]", capsys.readouterr().err)
    assert count is not None and 1 <= int(count.group(1)) <= 5  # eos may come first
    assert main(["generate", "hello"]) == 2
