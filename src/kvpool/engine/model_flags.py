"""The engine flags whose meaning depends on the model, resolved as vLLM resolves them, once, at
the command line's edge (`kvpool worker`, and `kvpool up` before it starts any process):

    --dtype auto          the checkpoint's own dtype (config.json `torch_dtype`, or `dtype` as
                          newer transformers write it): bfloat16 stays bfloat16, float32 stays
                          float32; absent or unknown: float32. A float16 checkpoint on the CPU
                          is computed in float32 (every float16 value widens exactly; float16
                          arithmetic on a CPU is slow and overflows where float32 does not),
                          and the note says so; `--dtype float16` forces it.
    --max-model-len       default: the model's context (max_position_embeddings, times the
                          factor of a linear rope_scaling), at most DEFAULT_MAX_MODEL_LEN;
                          given above the model's context: refused (ConfigError, one line).
    --device              must be one torch can allocate on here (ConfigError otherwise).

`resolve_flags` is pure over the parsed config.json; `read_flags` reads the folder;
`check_device` touches torch (imported there only: the emulated engine never needs it).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpool.engine.config import DTYPES
from kvpool.engine.model_config import ModelConfig
from kvpool.engine.model_files import read_json_object
from kvpool.errors import CheckpointError, ConfigError

AUTO = "auto"
DTYPE_CHOICES = (AUTO, *DTYPES)
DEFAULT_MAX_MODEL_LEN = 4096
"""The default context limit of a worker on a model whose own context is longer: requests that
long are rare on the CPU engine, and the proxy's limit follows the workers'."""
_ALIASES = {"float": "float32", "half": "float16", "bf16": "bfloat16", "fp16": "float16",
            "fp32": "float32"}


@dataclass(frozen=True)
class ModelFlags:
    dtype: str
    """One of DTYPES."""
    max_model_len: int
    context_len: int
    """The model's own context (what --max-model-len may not exceed)."""
    note: str = ""
    """Why the dtype is not the checkpoint's (empty: it is, or it was given)."""


def checkpoint_dtype(hf: dict[str, Any]) -> str | None:
    """The dtype config.json names, as one of DTYPES; None when it names none kvpool serves."""
    raw = hf.get("torch_dtype", hf.get("dtype"))
    if not isinstance(raw, str):
        return None
    name = raw.removeprefix("torch.")
    name = _ALIASES.get(name, name)
    return name if name in DTYPES else None


def context_len(model: ModelConfig) -> int:
    """The model's context in tokens: its positions, stretched by a linear RoPE scaling
    (vLLM's rule; llama3 scaling already states the stretched length)."""
    scaling = model.rope_scaling or {}
    if scaling.get("rope_type") == "linear":
        return int(model.max_position_embeddings * float(scaling["factor"]))
    return model.max_position_embeddings


def resolve_flags(hf: dict[str, Any], dtype: str, max_model_len: int | None, device: str,
                  where: str = "config.json") -> ModelFlags:
    """The dtype and context limit a worker runs with, given the flags (`dtype` AUTO or one of
    DTYPES; `max_model_len` None for the default). ConfigError naming the flag when one is
    out of range; `where` names the config file in that message."""
    model = ModelConfig.from_hf(hf)
    limit = context_len(model)
    if max_model_len is not None and max_model_len > limit:
        raise ConfigError(
            f"--max-model-len {max_model_len} is greater than the model's context of {limit} "
            f"tokens ({_context_source(model)} in {where}); give at most {limit}, or leave "
            f"it out")
    length = min(limit, DEFAULT_MAX_MODEL_LEN) if max_model_len is None else max_model_len
    if dtype != AUTO:
        if dtype not in DTYPES:
            raise ConfigError(f"--dtype must be one of {', '.join(DTYPE_CHOICES)}, got {dtype!r}")
        return ModelFlags(dtype, length, limit)
    own = checkpoint_dtype(hf)
    if own is None:
        return ModelFlags("float32", length, limit)
    if own == "float16" and device.split(":")[0] == "cpu":
        return ModelFlags("float32", length, limit,
                          "the checkpoint is float16; on the CPU it runs in float32 (exact "
                          "widening; float16 is slow there), --dtype float16 forces it")
    return ModelFlags(own, length, limit)


def _context_source(model: ModelConfig) -> str:
    scaling = model.rope_scaling or {}
    if scaling.get("rope_type") == "linear":
        return (f"max_position_embeddings={model.max_position_embeddings} x rope_scaling "
                f"factor {scaling['factor']}")
    return f"max_position_embeddings={model.max_position_embeddings}"


def read_flags(model_dir: Path, dtype: str, max_model_len: int | None,
               device: str = "cpu") -> ModelFlags:
    """`resolve_flags` over `model_dir`'s config.json; CheckpointError if it cannot be read."""
    path = Path(model_dir) / "config.json"
    hf = read_json_object(path)
    if not hf:
        raise CheckpointError(f"{path} not found or empty: a model folder needs config.json")
    try:
        return resolve_flags(hf, dtype, max_model_len, device, str(path))
    except ConfigError as exc:
        if str(exc).startswith("--"):
            raise
        raise CheckpointError(f"{path}: {exc}") from None


def check_device(device: str) -> None:
    """ConfigError, one line, unless torch can allocate a tensor on `device` here (`meta`
    holds no values: refused too)."""
    import torch

    try:
        if torch.device(device).type == "meta":
            raise ValueError("a meta tensor holds no values")
        torch.empty(1, device=torch.device(device))
    except (RuntimeError, AssertionError, ValueError, TypeError) as exc:
        raise ConfigError(f"--device {device}: torch cannot use it here ({_gist(exc)}); cuda "
                          f"needs a CUDA build of torch and a visible GPU, cpu always works") from None


def _gist(exc: BaseException) -> str:
    """The first sentence of `exc`'s message, at most 100 characters."""
    text = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    text = text.split(". ")[0]
    return text if len(text) <= 100 else text[:97] + "..."


def checked_flags(model_dir: Path, dtype: str, max_model_len: int | None, device: str,
                  engine: str = "torch") -> ModelFlags:
    """`read_flags`, then `check_device` for the torch engine (an emulated one computes
    nothing on a device); one ConfigError for the first flag refused."""
    flags = read_flags(model_dir, dtype, max_model_len, device)
    if engine == "torch":
        check_device(device)
    return flags
