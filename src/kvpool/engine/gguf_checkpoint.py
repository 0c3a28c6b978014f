"""GGUF checkpoints: a Llama-architecture GGUF file (llama.cpp's format: tensors, possibly
quantized, and the model's metadata, tokenizer and chat template in one file) turned into the
Hugging Face folder the engine loads (`config.json`, `model.safetensors`, `tokenizer.json`,
`tokenizer_config.json`, `chat_template.jinja`, `generation_config.json`).

- Tensors are dequantized to float32 with the `gguf` package and renamed to the Hugging Face
  names (`TENSOR_NAMES`). llama.cpp stores the Q and K projections with the rows of each head
  interleaved for its rotary kernel; `_unpermute` restores Hugging Face's order.
- The tokenizer is rebuilt from the file's vocabulary and merges (kvpool.engine.gguf_tokenizer).
- The file is untrusted input: its header is checked first (kvpool.engine.gguf_header), then
  its config (bounded, kvpool.engine.model_config) and every tensor's name and shape, all
  before a tensor is dequantized or anything is written; each failure is one CheckpointError
  that names the file.
- `import_gguf` writes the folder; `cached_import` imports once per file into a cache folder
  keyed by the digest of the file's contents, so `--model FILE.gguf` works directly. The
  engine's KV identity then covers the imported folder's weights (`identity`).
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvpool.engine.gguf_header import parse_header
from kvpool.engine.gguf_tokenizer import checked_tokenizer
from kvpool.engine.weights_digest import file_digests
from kvpool.errors import CheckpointError, ConfigError

TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
CACHE_ENV = "KVPOOL_MODEL_CACHE"
IMPORT_MARKER = "kvpool_gguf.json"
"""Written last by `import_gguf`: the folder is complete."""


@dataclass(frozen=True)
class GgufFile:
    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, np.ndarray]
    """Hugging Face name -> float32 array in Hugging Face's layout."""
    tokenizer: Any
    """The `tokenizers.Tokenizer` of the file's vocabulary (kvpool.engine.gguf_tokenizer)."""
    tokenizer_config: dict[str, Any]
    """tokenizer_config.json: the BOS/EOS tokens, the context length, the chat template."""


def _reader(path: Path) -> Any:
    try:
        from gguf import GGUFReader
    except ImportError:
        raise CheckpointError("reading GGUF needs the `gguf` package (pip install gguf)") from None
    _check_is_file(path)
    check_header(path)
    try:
        return GGUFReader(str(path))
    except READ_ERRORS as exc:
        raise CheckpointError(f"{path} is not a GGUF file kvpool can read: {exc}") from None


READ_ERRORS = (ValueError, OSError, KeyError, IndexError, TypeError, OverflowError, struct.error)
"""What the `gguf` package raises on a malformed file (a header that passed `check_header` is
not expected to get there; this is the second line)."""


def check_header(path: Path) -> None:
    """CheckpointError, naming `path`, when its GGUF header is malformed (gguf_header)."""
    try:
        with path.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                raise CheckpointError(f"{path} is not a GGUF file: it is empty")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                parse_header(buf, size)
    except CheckpointError as exc:
        if str(exc).startswith(str(path)):
            raise
        raise CheckpointError(f"{path}: {exc}") from None
    except OSError as exc:
        raise CheckpointError(f"cannot read GGUF file {path}: {exc}") from None


def _value(field: Any) -> Any:
    """A metadata field's value: a string, a number, or a list of either."""
    from gguf import GGUFValueType

    kind = field.types[0]
    if kind == GGUFValueType.ARRAY:
        item = field.types[-1]
        return [_scalar(field.parts[i], item) for i in field.data]
    return _scalar(field.parts[field.data[0]], kind)


def _scalar(part: np.ndarray, kind: Any) -> Any:
    from gguf import GGUFValueType

    if kind == GGUFValueType.STRING:
        return bytes(part).decode("utf-8")
    return part.tolist()[0]


ImportProgress = Callable[[int, int], None]
"""Told (steps done, steps in all) as an import goes: one step per tensor dequantized, one for
writing the folder; first called once every check has passed."""


def read_gguf(path: str | Path, progress: ImportProgress | None = None) -> GgufFile:
    """The metadata, tokenizer and float32 tensors (Hugging Face names and layout) of a GGUF
    file; every check (header, config, tensor shapes, tokenizer, chat template) comes before
    the first tensor is dequantized. `progress` counts the tensors, out of their number + 1."""
    from gguf.quants import dequantize

    file = Path(path)
    reader = _reader(file)
    try:
        meta = {name: _value(field) for name, field in reader.fields.items()}
    except READ_ERRORS as exc:
        raise CheckpointError(f"{file}: unreadable metadata ({exc})") from None
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise CheckpointError(f"{file}: architecture {arch!r}; kvpool imports GGUF llama models")
    config = _checked_config(file, meta)
    heads, kv_heads = config.num_heads, config.num_kv_heads
    _check_tensors(file, reader, config)
    tokenizer, tok_cfg = checked_tokenizer(file, meta, config.max_position_embeddings)
    tensors: dict[str, np.ndarray] = {}
    steps = len(reader.tensors) + 1
    for i, t in enumerate(reader.tensors):
        if progress is not None:
            progress(i, steps)
        name = hf_name(t.name)
        data = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        data = data.reshape([int(d) for d in reversed(t.shape.tolist())])
        if t.name.endswith("attn_q.weight"):
            data = _unpermute(data, heads)
        elif t.name.endswith("attn_k.weight"):
            data = _unpermute(data, kv_heads)
        tensors[name] = data
    return GgufFile(file, meta, tensors, tokenizer, tok_cfg)


def _checked_config(file: Path, meta: dict[str, Any]) -> Any:
    """The ModelConfig of the file's metadata, bounded before any tensor is read."""
    from kvpool.engine.config import ModelConfig

    try:
        return ModelConfig.from_hf(hf_config(meta, tied=False))
    except CheckpointError as exc:
        raise CheckpointError(f"{file}: {exc}") from None
    except ConfigError as exc:
        raise CheckpointError(f"{file}: the metadata's {exc}") from None


def _check_tensors(file: Path, reader: Any, config: Any) -> None:
    """Every tensor the config needs, with its exact shape, and nothing else (the header's
    shapes: nothing is read yet)."""
    import dataclasses

    from kvpool.engine.checkpoint import _expected_shapes

    tied = all(t.name != "output.weight" for t in reader.tensors)
    expected = _expected_shapes(dataclasses.replace(config, tie_word_embeddings=tied))
    for t in reader.tensors:
        try:
            name = hf_name(t.name)
        except CheckpointError as exc:
            raise CheckpointError(f"{file}: {exc}") from None
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        if name not in expected:
            raise CheckpointError(f"{file}: unexpected tensor {t.name!r} for the metadata's "
                                  f"{config.num_layers} layers")
        if shape != expected.pop(name):
            raise CheckpointError(f"{file}: tensor {t.name!r} has shape {shape}, the metadata "
                                  f"needs {_expected_shapes(config)[name]}")
    if expected:
        raise CheckpointError(f"{file}: missing tensor {sorted(expected)[0]!r} "
                              f"({len(expected)} missing in all)")


def hf_name(name: str) -> str:
    """The Hugging Face name of a GGUF tensor (`blk.3.attn_q.weight` ->
    `model.layers.3.self_attn.q_proj.weight`)."""
    if name in TENSOR_NAMES:
        return TENSOR_NAMES[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in LAYER_NAMES:
        return f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}"
    raise CheckpointError(f"unknown GGUF tensor {name!r}")


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head row interleaving of a Q or K projection: its rows are, per
    head, the pairs (i, i + d/2) side by side; Hugging Face keeps the two halves apart."""
    rows = w.shape[0]
    return (w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2)
            .reshape(w.shape))


REQUIRED_KEYS = ("llama.embedding_length", "llama.feed_forward_length", "llama.block_count",
                 "llama.attention.head_count", "llama.attention.layer_norm_rms_epsilon",
                 "tokenizer.ggml.tokens")


def hf_config(meta: dict[str, Any], tied: bool) -> dict[str, Any]:
    """config.json for the file's Llama model (values as the file gives them: ModelConfig
    types and bounds them)."""
    missing = [k for k in REQUIRED_KEYS if k not in meta]
    if missing:
        raise CheckpointError(f"GGUF metadata {missing[0]} is missing ({len(missing)} required "
                              f"keys missing in all)")
    heads = meta["llama.attention.head_count"]
    tokens = meta["tokenizer.ggml.tokens"]
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": meta.get("llama.vocab_size") or (len(tokens) if isinstance(tokens, list)
                                                       else tokens),
        "hidden_size": meta["llama.embedding_length"],
        "intermediate_size": meta["llama.feed_forward_length"],
        "num_hidden_layers": meta["llama.block_count"], "num_attention_heads": heads,
        "num_key_value_heads": meta.get("llama.attention.head_count_kv", heads),
        **({"head_dim": meta["llama.rope.dimension_count"]}
           if "llama.rope.dimension_count" in meta else {}),
        "max_position_embeddings": meta.get("llama.context_length", 4096),
        "rms_norm_eps": _f32(meta["llama.attention.layer_norm_rms_epsilon"]),
        "rope_theta": meta.get("llama.rope.freq_base", 10000.0),
        "tie_word_embeddings": tied, "torch_dtype": "float32",
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }


def _f32(value: Any) -> Any:
    """A float32 metadata value as the decimal it was written from (1e-05, not 9.99e-06);
    anything but a number as it is (ModelConfig refuses it)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return value
    return float(f"{float(value):.7g}")


def import_gguf(path: str | Path, out_dir: str | Path,
                progress: ImportProgress | None = None) -> Path:
    """Write the Hugging Face folder of a GGUF file into `out_dir` (created); returns it."""
    from safetensors.numpy import save_file

    gg = read_gguf(path, progress)
    steps = len(gg.tensors) + 1
    if progress is not None:
        progress(steps - 1, steps)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tied = "lm_head.weight" not in gg.tensors
    config = hf_config(gg.metadata, tied)
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", {"eos_token_id": config["eos_token_id"],
                                                 "bos_token_id": config["bos_token_id"]})
    gg.tokenizer.save(str(out / "tokenizer.json"))
    if "chat_template" in gg.tokenizer_config:
        (out / "chat_template.jinja").write_text(gg.tokenizer_config["chat_template"])
    _write_json(out / "tokenizer_config.json", gg.tokenizer_config)
    save_file({k: np.ascontiguousarray(v) for k, v in gg.tensors.items()},
              str(out / "model.safetensors"), metadata={"format": "pt"})
    _write_json(out / IMPORT_MARKER, {"source": str(gg.path.resolve()),
                                       "name": gg.metadata.get("general.name"),
                                       "served_name": gg.path.name.split(".")[0]})
    if progress is not None:
        progress(steps, steps)
    return out


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=1) + "\n")


def served_name(model_dir: Path) -> str:
    """The name /v1/models gives a model folder: a GGUF import's file name without its
    suffixes (SmolLM2-135M-Instruct), else the folder's name."""
    from kvpool.engine.model_files import read_json_object

    name = read_json_object(model_dir / IMPORT_MARKER).get("served_name")
    if isinstance(name, str) and name:
        return name
    return model_dir.resolve().name


def kvpool_cache() -> Path:
    """kvpool's folder under `$XDG_CACHE_HOME` (default ~/.cache): models, logs."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "kvpool"


def cache_dir() -> Path:
    """Where imported GGUF models live: `$KVPOOL_MODEL_CACHE`, else kvpool/models under
    `$XDG_CACHE_HOME` (default ~/.cache), beside the tiny model."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env)
    return kvpool_cache() / "models"


def gguf_digest(file: Path) -> str:
    """The content digest of a GGUF file (cached beside it where its folder is writable)."""
    try:
        return file_digests(file.parent, [file.name])[file.name]
    except OSError as exc:
        raise CheckpointError(f"cannot read GGUF file {file}: {exc}") from exc


def cached_import(path: str | Path, progress: ImportProgress | None = None) -> Path:
    """The imported folder of GGUF file `path`, importing it on first use into `cache_dir()`
    (keyed by the file's name and the digest of its contents, kept beside it by
    `weights_digest`: a file rewritten in place is imported again). The import is written to a
    temporary folder and renamed, so an interrupted one is never used."""
    file = Path(path)
    _check_is_file(file)
    target = cache_dir() / f"{file.stem}-{gguf_digest(file)[:16]}"
    if (target / IMPORT_MARKER).is_file():
        return target
    tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")
    try:
        import_gguf(file, tmp, progress)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        os.replace(tmp, target)
    except OSError:  # another process finished the same import first
        shutil.rmtree(tmp, ignore_errors=True)
        if not (target / IMPORT_MARKER).is_file():
            raise
    return target


def _check_is_file(path: Path) -> None:
    """CheckpointError unless `path` is a file; a folder gets told what it is for."""
    if path.is_dir():
        raise CheckpointError(
            f"{path} is a folder; this takes one GGUF file (a .gguf). A Hugging Face folder "
            "(config.json, *.safetensors, tokenizer.json) needs no import: give it to --model "
            "as it is")
    if not path.is_file():
        raise CheckpointError(f"GGUF file not found: {path}")
