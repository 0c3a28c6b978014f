"""Load a local Hugging Face checkpoint folder: config.json, *.safetensors (one file, or shards
named by model.safetensors.index.json), tokenizer.json and tokenizer_config.json.

Loading is strict: every tensor the model needs must be there with its exact shape, and nothing
else may be; otherwise CheckpointError names the tensor, the file and the shapes. The folder's
files are untrusted input: the config is bounded before the model is built
(kvpool.engine.model_config), the small files are read by kvpool.engine.model_files, and every
shape is checked against the safetensors header before a tensor is read.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from kvpool.engine.chat_template import compile_template, read_chat_template
from kvpool.engine.config import ModelConfig
from kvpool.engine.model import CausalLM, rope_inv_freq
from kvpool.engine.model_config import eos_token_ids
from kvpool.engine.model_files import (
    INDEX_NAME,
    open_tokenizer,
    read_json,
    read_json_object,
    weight_index,
)
from kvpool.errors import CheckpointError, ConfigError

__all__ = ["CheckpointError", "Tokenizer", "check_checkpoint", "load_model", "load_tokenizer",
           "read_model_config"]

LAYER_0 = "model.layers.0."
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def read_model_config(model_dir: str | Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path} not found: a model folder needs config.json")
    try:
        config = ModelConfig.from_hf(read_json(path))
    except CheckpointError:
        raise
    except ConfigError as exc:
        raise CheckpointError(f"{path}: {exc}") from None
    return _with_generation_eos(config, Path(model_dir) / "generation_config.json")


def _with_generation_eos(config: ModelConfig, path: Path) -> ModelConfig:
    """Instruct models often list their end-of-turn tokens only in generation_config.json."""
    try:
        extra = eos_token_ids(read_json_object(path))
    except CheckpointError:
        raise
    except ConfigError as exc:
        raise CheckpointError(f"{path}: {exc}") from None
    merged = tuple(dict.fromkeys([*config.eos_token_ids, *extra]))
    return dataclasses.replace(config, eos_token_ids=merged)


def weight_files(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file that holds it."""
    if (model_dir / INDEX_NAME).is_file():
        return weight_index(model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors in {model_dir}")
    out: dict[str, Path] = {}
    for file in files:
        try:
            with safe_open(str(file), "pt") as f:
                out.update(dict.fromkeys(f.keys(), file))
        except SafetensorError as exc:
            raise CheckpointError(f"{file}: not a readable safetensors file ({exc})") from exc
    return out


def _expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model for `config` loads, and its shape: a one-layer model built on the
    meta device, its layer's tensors repeated for every layer (a thousand layers in
    milliseconds)."""
    with torch.device("meta"):
        model = CausalLM(dataclasses.replace(config, num_layers=1))
    expected: dict[str, tuple[int, ...]] = {}
    for name, tensor in model.state_dict().items():
        rest = name.removeprefix(LAYER_0)
        names = [name] if rest == name else [f"model.layers.{i}.{rest}"
                                             for i in range(config.num_layers)]
        expected.update(dict.fromkeys(names, tuple(tensor.shape)))
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight")
    return expected


def check_checkpoint(model_dir: str | Path) -> None:
    """What `load_model` would refuse, found without reading a weight: the config, every
    tensor's name and shape (from the safetensors headers) and the tokenizer.
    CheckpointError names the first problem."""
    folder = Path(model_dir)
    expected = _expected_shapes(read_model_config(folder))
    files = weight_files(folder)
    _check_names(folder, files, expected)
    for file in sorted(set(files.values())):
        if not file.is_file():
            raise CheckpointError(f"{file} not found (named by {folder.name}'s weight index)")
        try:
            with safe_open(str(file), "pt") as f:
                for name in f.keys():
                    _check_shape(file, name, tuple(f.get_slice(name).get_shape()), expected)
        except (OSError, SafetensorError) as exc:
            raise CheckpointError(f"{file}: not a readable safetensors file ({exc})") from exc
    template = load_tokenizer(folder).chat_template
    if template:
        compile_template(template, str(folder))


def _check_shape(file: Path, name: str, shape: tuple[int, ...],
                 expected: dict[str, tuple[int, ...]]) -> None:
    if name in expected and shape != expected[name]:
        raise CheckpointError(f"tensor {name!r} in {file.name} has shape {shape}, the config "
                              f"needs {expected[name]}")


def load_model(model_dir: str | Path, dtype: str = "float32", device: str = "cpu") -> CausalLM:
    """Build the model for `model_dir` and load its weights (strictly)."""
    folder = Path(model_dir)
    config = read_model_config(folder)
    with torch.device("meta"):
        model = CausalLM(config)
    expected = _expected_shapes(config)
    state = _read_tensors(folder, expected, DTYPES[dtype], device)
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.rotary.inv_freq = rope_inv_freq(config).to(device)
    return model.eval()


def _read_tensors(folder: Path, expected: dict[str, tuple[int, ...]], dtype: torch.dtype,
                  device: str) -> dict[str, torch.Tensor]:
    files = weight_files(folder)
    _check_names(folder, files, expected)
    state: dict[str, torch.Tensor] = {}
    by_file: dict[Path, list[str]] = {}
    for name in expected:
        by_file.setdefault(files[name], []).append(name)
    for file, names in by_file.items():
        try:
            with safe_open(str(file), "pt") as f:
                for name in names:
                    _check_shape(file, name, tuple(f.get_slice(name).get_shape()), expected)
                    state[name] = f.get_tensor(name).to(device=device, dtype=dtype)
        except (OSError, SafetensorError) as exc:
            raise CheckpointError(f"{file}: not a readable safetensors file ({exc})") from exc
    return state


def _check_names(folder: Path, files: dict[str, Path],
                 expected: dict[str, tuple[int, ...]]) -> None:
    unexpected = sorted(n for n in set(files) - set(expected) if not _ignorable(n))
    if unexpected:
        raise CheckpointError(f"unexpected tensor {unexpected[0]!r} in {files[unexpected[0]].name}"
                              f" ({len(unexpected)} unexpected in all) for "
                              f"{folder / 'config.json'}")
    missing = sorted(set(expected) - set(files))
    if missing:
        raise CheckpointError(f"missing tensor {missing[0]!r} ({len(missing)} missing in all) "
                              f"in {folder}")


def _ignorable(name: str) -> bool:
    """Tensors some checkpoints carry that the model derives itself: a tied lm_head's copy of
    the embeddings, and RoPE frequencies saved by older Llama conversions."""
    return name == "lm_head.weight" or name.endswith("rotary_emb.inv_freq")


@dataclass
class Tokenizer:
    """tokenizer.json plus the bits of tokenizer_config.json the engine needs."""

    backend: Any  # tokenizers.Tokenizer
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    chat_template: str | None

    def encode(self, text: str) -> list[int]:
        return list(self.backend.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        return str(self.backend.decode(ids, skip_special_tokens=True))

    def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise CheckpointError("this tokenizer has no chat_template")
        import jinja2
        template = jinja2.Environment().from_string(self.chat_template)
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                               bos_token=self._token(self.bos_token_id),
                               eos_token=self._token(self.eos_token_ids[0] if self.eos_token_ids else None))

    def _token(self, token_id: int | None) -> str:
        return "" if token_id is None else str(self.backend.id_to_token(token_id))


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    folder = Path(model_dir)
    backend = open_tokenizer(folder / "tokenizer.json")
    cfg = read_json_object(folder / "tokenizer_config.json")

    def token_id(entry: Any) -> int | None:
        text = entry.get("content") if isinstance(entry, dict) else entry
        return backend.token_to_id(text) if isinstance(text, str) else None

    eos = token_id(cfg.get("eos_token"))
    return Tokenizer(backend, token_id(cfg.get("bos_token")),
                     () if eos is None else (eos,), read_chat_template(folder)[0])
