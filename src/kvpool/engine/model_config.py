"""The transformer's shape (`ModelConfig`), read from a Hugging Face config.json as untrusted
input: every size-like value is typed and bounded (`ModelLimits`) before anything is built or
allocated, so a hostile or corrupted file is refused with one ConfigError that names the
field, its value, the bounds and the fix, never a traceback or a model that builds for minutes.

The limits are generous (above every published open model) but finite; divisibility
(hidden_size by num_attention_heads when head_dim is not given, num_attention_heads by
num_key_value_heads) and the RoPE values are checked too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from kvpool.errors import ConfigError

ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}
FIX = "fix the model's config.json (or the GGUF file it was imported from)"


@dataclass(frozen=True)
class ModelLimits:
    """The largest model shape kvpool accepts (each value's lower bound is 1)."""

    max_layers: int = 1024
    max_heads: int = 1024
    """num_attention_heads and num_key_value_heads."""
    max_hidden_size: int = 65536
    max_intermediate_size: int = 1 << 20
    max_vocab_size: int = 4 << 20
    max_position_embeddings: int = 1 << 24
    max_head_dim: int = 1024
    max_rope_theta: float = 1e12
    max_rope_factor: float = 1024.0
    """rope_scaling's factor (linear and llama3) and llama3's low/high frequency factors."""


MODEL_LIMITS = ModelLimits()

_BOUNDS = {  # ModelConfig field -> (config.json name, ModelLimits attribute)
    "num_layers": ("num_hidden_layers", "max_layers"),
    "num_heads": ("num_attention_heads", "max_heads"),
    "num_kv_heads": ("num_key_value_heads", "max_heads"),
    "hidden_size": ("hidden_size", "max_hidden_size"),
    "intermediate_size": ("intermediate_size", "max_intermediate_size"),
    "vocab_size": ("vocab_size", "max_vocab_size"),
    "max_position_embeddings": ("max_position_embeddings", "max_position_embeddings"),
    "head_dim": ("head_dim", "max_head_dim"),
}


@dataclass(frozen=True)
class ModelConfig:
    """The transformer's shape, read from a Hugging Face config.json (`from_hf`). Every
    construction checks the bounds of `MODEL_LIMITS` (ConfigError naming the field)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    """None, {"rope_type": "linear", "factor"} or {"rope_type": "llama3", ...}."""
    attention_bias: bool = False
    """q/k/v projections carry a bias (always for Qwen2)."""
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name, (hf_name, limit) in _BOUNDS.items():
            _check_range(hf_name, getattr(self, name), 1, getattr(MODEL_LIMITS, limit))
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_attention_heads ({self.num_heads}) must be a multiple of "
                              f"num_key_value_heads ({self.num_kv_heads}): {FIX}")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for RoPE, got {self.head_dim}: {FIX}")
        if not 0 < self.rms_norm_eps < 1:
            raise ConfigError(f"rms_norm_eps must be in (0, 1), got {self.rms_norm_eps}: {FIX}")
        if not 0 < self.rope_theta <= MODEL_LIMITS.max_rope_theta:
            raise ConfigError(f"rope_theta must be in (0, {MODEL_LIMITS.max_rope_theta:g}], got "
                              f"{self.rope_theta}: {FIX}")
        ids = (*self.eos_token_ids, *(() if self.bos_token_id is None else (self.bos_token_id,)))
        if any(not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in ids):
            raise ConfigError(f"bos_token_id and eos_token_id must be token ids (integers >= 0), "
                              f"got {self.bos_token_id!r} and {list(self.eos_token_ids)!r}: {FIX}")

    @classmethod
    def from_hf(cls, hf: Any) -> ModelConfig:
        """The config of a parsed config.json; ConfigError for anything missing, mistyped or
        out of bounds (checked before any size is used)."""
        if not isinstance(hf, dict):
            raise ConfigError(f"config.json must hold a JSON object, got {type(hf).__name__}")
        arch = _architecture(hf)
        heads, hidden = _int(hf, "num_attention_heads"), _int(hf, "hidden_size")
        return cls(
            architecture=arch, vocab_size=_int(hf, "vocab_size"), hidden_size=hidden,
            intermediate_size=_int(hf, "intermediate_size"),
            num_layers=_int(hf, "num_hidden_layers"), num_heads=heads,
            num_kv_heads=_int(hf, "num_key_value_heads", heads),
            head_dim=_head_dim(hf, hidden, heads),
            max_position_embeddings=_int(hf, "max_position_embeddings", 4096),
            rms_norm_eps=_float(hf, "rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(hf), rope_scaling=_rope_scaling(hf),
            attention_bias=ARCHITECTURES[arch] == "qwen2" or bool(hf.get("attention_bias")),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            bos_token_id=_optional_id(hf.get("bos_token_id"), "bos_token_id"),
            eos_token_ids=eos_token_ids(hf),
        )


def _check_range(name: str, value: float, low: float, high: float) -> None:
    if not low <= value <= high:
        raise ConfigError(f"{name} must be in {low}..{high}, got {value}: {FIX}")


def _architecture(hf: dict[str, Any]) -> str:
    archs = hf.get("architectures") or []
    archs = archs if isinstance(archs, list) else [archs]
    arch = next((a for a in archs if isinstance(a, str) and a in ARCHITECTURES), None)
    if arch is None:
        raise ConfigError(f"unknown architecture {archs or hf.get('model_type')!r}; "
                          f"supported: {', '.join(ARCHITECTURES)}")
    return arch


_MISSING = object()


def _number(hf: dict[str, Any], name: str, default: Any) -> Any:
    value = hf.get(name)
    if value is None:
        if default is _MISSING:
            raise ConfigError(f"config.json has no {name}: {FIX}")
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name} must be a number, got {value!r}: {FIX}")
    if not math.isfinite(value):
        raise ConfigError(f"{name} must be a finite number, got {value!r}: {FIX}")
    return value


def _int(hf: dict[str, Any], name: str, default: Any = _MISSING) -> int:
    value = _number(hf, name, default)
    if isinstance(value, float) and not value.is_integer():
        raise ConfigError(f"{name} must be an integer, got {value!r}: {FIX}")
    return int(value)


def _float(hf: dict[str, Any], name: str, default: Any = _MISSING) -> float:
    return float(_number(hf, name, default))


def _head_dim(hf: dict[str, Any], hidden: int, heads: int) -> int:
    """config.json's head_dim, else hidden_size / num_attention_heads (which must divide)."""
    if hf.get("head_dim"):
        return _int(hf, "head_dim")
    _check_range("num_attention_heads", heads, 1, MODEL_LIMITS.max_heads)
    if hidden % heads:
        raise ConfigError(f"hidden_size ({hidden}) must be a multiple of num_attention_heads "
                          f"({heads}) when config.json gives no head_dim: {FIX}")
    return hidden // heads


def _optional_id(value: Any, name: str) -> int | None:
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise ConfigError(f"{name} must be a token id (an integer), got {value!r}: {FIX}")


def eos_token_ids(hf: dict[str, Any]) -> tuple[int, ...]:
    """A config.json's `eos_token_id`: one id, a list of them, or none (ConfigError for
    anything else)."""
    eos = hf.get("eos_token_id")
    ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
    return tuple(i for i in (_optional_id(e, "eos_token_id") for e in ids) if i is not None)


def _rope_theta(hf: dict[str, Any]) -> float:
    params = hf.get("rope_parameters")
    params = params if isinstance(params, dict) else {}
    if hf.get("rope_theta") is not None:
        return _float(hf, "rope_theta")
    return _float(params, "rope_theta", 10000.0)


def _rope_scaling(hf: dict[str, Any]) -> dict[str, Any] | None:
    """transformers 4.x writes `rope_scaling`; 5.x folds it into `rope_parameters`."""
    scaling = hf.get("rope_scaling") or hf.get("rope_parameters")
    if not scaling:
        return None
    if not isinstance(scaling, dict):
        raise ConfigError(f"rope_scaling must be a JSON object, got {scaling!r}: {FIX}")
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if kind == "default":
        return None
    if kind not in ("linear", "llama3"):
        raise ConfigError(f"unsupported rope_scaling type {kind!r}; supported: linear, llama3")
    _check_rope_scaling(scaling, kind)
    return {k: v for k, v in scaling.items() if k != "type"} | {"rope_type": kind}


def _check_rope_scaling(scaling: dict[str, Any], kind: str) -> None:
    names = ("factor",) if kind == "linear" else ("factor", "low_freq_factor", "high_freq_factor")
    for name in names:
        value = _float(scaling, name)
        if not 0 < value <= MODEL_LIMITS.max_rope_factor:
            raise ConfigError(f"rope_scaling {name} must be in (0, "
                              f"{MODEL_LIMITS.max_rope_factor:g}], got {value:g}: {FIX}")
    if kind == "llama3":
        if _float(scaling, "high_freq_factor") <= _float(scaling, "low_freq_factor"):
            raise ConfigError(f"rope_scaling high_freq_factor must be above low_freq_factor, got "
                              f"{scaling['high_freq_factor']} and "
                              f"{scaling['low_freq_factor']}: {FIX}")
        old_len = _int(scaling, "original_max_position_embeddings")
        _check_range("rope_scaling original_max_position_embeddings", old_len, 1,
                     MODEL_LIMITS.max_position_embeddings)
