"""`kvpool worker`'s model-dependent flags as a user meets them, in real processes: the
checkpoint's dtype by default, a context above the model's refused in one line (exit 2), a
device torch cannot use refused alike."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvpool.engine.tiny import TinySpec, make_tiny
from tests.support.procs import python_env


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny checkpoint whose config.json says bfloat16 (as most published ones do)."""
    folder = make_tiny(tmp_path_factory.mktemp("bf16") / "m", TinySpec(arch="llama", seed=5))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"torch_dtype": "bfloat16"}))
    return folder


def worker(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "kvpool", "worker", *args], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=python_env())


def refusal(*args: str) -> tuple[int, list[str]]:
    proc = worker(*args)
    _, err = proc.communicate(timeout=60)
    return proc.returncode, err.splitlines()


def test_a_bf16_checkpoint_is_served_in_bf16_with_the_models_context(bf16_model: Path) -> None:
    proc = worker("--model", str(bf16_model), "--port", "0")
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.endswith(" (bfloat16, max-model-len 2048)\n"), line
    finally:
        proc.kill()
        proc.wait()


def test_a_context_above_the_models_is_one_line_and_exit_2(bf16_model: Path) -> None:
    code, lines = refusal("--model", str(bf16_model), "--max-model-len", "999999")
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].endswith(
        "--max-model-len 999999 is greater than the model's context of 2048 tokens "
        f"(max_position_embeddings=2048 in {bf16_model / 'config.json'}); give at most 2048, "
        "or leave it out"), lines


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine's torch has CUDA")
def test_a_device_torch_cannot_use_is_one_line_and_exit_2(bf16_model: Path) -> None:
    code, lines = refusal("--model", str(bf16_model), "--device", "cuda")
    assert code == 2 and len(lines) == 1, lines
    assert "--device cuda: torch cannot use it here (Torch not compiled with CUDA enabled)" \
        in lines[0], lines
