"""Typed, frozen configuration of the engine: the model's shape (from a checkpoint's
config.json, bounded: kvpool.engine.model_config), the engine's capacity, and one request's
sampling parameters."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from kvpool.engine.model_config import (  # noqa: F401  (the model's shape lives there)
    ARCHITECTURES,
    MODEL_LIMITS,
    ModelConfig,
    ModelLimits,
    eos_token_ids,
)
from kvpool.errors import ConfigError

DTYPES = ("float32", "bfloat16", "float16")
PREFILL_MODES = ("chunked", "whole")


@dataclass(frozen=True)
class EngineConfig:
    """Capacity and numerics of one engine instance."""

    block_size: int = 16
    """Tokens per KV block; also the granularity of prefix hashing and of the pool's keys."""
    num_blocks: int = 256
    """KV blocks in the local paged cache (capacity = num_blocks * block_size tokens)."""
    max_num_seqs: int = 32
    """Sequences running at once (continuous batching)."""
    max_prefill_chunk: int = 512
    """Prompt tokens computed per step, summed over sequences (chunked prefill)."""
    max_model_len: int = 2048
    dtype: str = "float32"
    device: str = "cpu"
    prefill_mode: str = "chunked"
    """chunked: every step carries the running decodes plus prompt chunks (up to
    `max_prefill_chunk` tokens); whole: vLLM's old default scheduler, where a step of whole
    prompts (up to `max_prefill_chunk` tokens, at least one prompt) pauses every decode."""
    enable_prefix_caching: bool = True
    """Reuse full blocks still held in the local cache (off: every prompt is computed or
    loaded from the pool from its first block)."""
    max_prefill_seqs: int = 0
    """Prompts computed in one step at most (0: no limit; 1: one prompt at a time, as a
    disaggregated prefill instance runs them)."""

    def __post_init__(self) -> None:
        for name in ("block_size", "num_blocks", "max_num_seqs", "max_prefill_chunk",
                     "max_model_len"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.prefill_mode not in PREFILL_MODES:
            raise ConfigError(f"prefill_mode must be one of {PREFILL_MODES}, "
                              f"got {self.prefill_mode!r}")
        if self.max_prefill_seqs < 0:
            raise ConfigError(f"max_prefill_seqs must be >= 0, got {self.max_prefill_seqs}")

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size


MAX_LOGPROBS = 20
"""The most alternatives a request may ask for at each position (vLLM's default limit)."""


MAX_SALT_CHARS = 512
"""The longest cache_salt the engine takes (a request's own, within its tenant's: half each)."""

MAX_STOP_TOKEN_IDS = 1024
"""The most stop_token_ids one request may give: bounds the work of its min_tokens mask."""

MAX_LOGIT_BIAS = 1024
"""The most logit_bias entries one request may give: bounds the work of applying them."""


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens; the one definition, used by the engine and carried
    as is on the worker API (docs/worker-api.md). temperature 0 is greedy. Logprobs are those
    of the model's raw distribution (log-softmax of its logits, before temperature,
    penalties and bias), as vLLM reports them by default."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    """0 = no top-k cut."""
    seed: int | None = None
    """Seed of the request's own torch.Generator (None: a random one)."""
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    min_tokens: int = 0
    """No EOS or stop token is sampled before this many output tokens."""
    presence_penalty: float = 0.0
    """Subtracted once from the logit of every token the output already holds (OpenAI's)."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time the output already holds it."""
    repetition_penalty: float = 1.0
    """A logit of a token in the prompt or the output is divided by it if positive, multiplied
    if negative (the CTRL / Hugging Face rule; 1 = off)."""
    logit_bias: dict[int, float] = field(default_factory=dict)
    """Added to the logits of these token ids before sampling (-100..100)."""
    logprobs: int | None = None
    """Report each output token's logprob and this many top alternatives (None: none)."""
    prompt_logprobs: int | None = None
    """Report each prompt token's logprob and this many top alternatives (None: none). The
    prompt is then computed whole (no prefix reuse: cached tokens have no logits)."""
    cache_salt: str | None = None
    """The request's KV is reused only by requests with the same salt (blocks.salted_root);
    None: by every request of the model."""

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ConfigError(f"max_tokens must be >= 1, got {self.max_tokens}")
        floats = (self.temperature, self.top_p, self.presence_penalty, self.frequency_penalty,
                  self.repetition_penalty, *self.logit_bias.values())
        if not all(math.isfinite(v) for v in floats):
            raise ConfigError("sampling values must be finite numbers (no inf or nan)")
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ConfigError(f"need temperature >= 0, 0 < top_p <= 1, top_k >= 0; got "
                              f"{self.temperature}, {self.top_p}, {self.top_k}")
        if self.cache_salt is not None and not 0 < len(self.cache_salt) <= MAX_SALT_CHARS:
            raise ConfigError(f"cache_salt must be 1..{MAX_SALT_CHARS} characters")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise ConfigError(f"seed must be a 64-bit integer, got {self.seed}")
        self._check_processors()
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and not 0 <= k <= MAX_LOGPROBS:
                raise ConfigError(f"{name} must be in 0..{MAX_LOGPROBS}, got {k}")

    def _check_processors(self) -> None:
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ConfigError(f"min_tokens must be in 0..max_tokens ({self.max_tokens}), got "
                              f"{self.min_tokens}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ConfigError(f"{name} must be in -2..2, got {getattr(self, name)}")
        if not 0.01 <= self.repetition_penalty <= 100:
            raise ConfigError("repetition_penalty must be in 0.01..100 (the logits it scales "
                              f"stay finite), got {self.repetition_penalty}")
        for name, cap in (("stop_token_ids", MAX_STOP_TOKEN_IDS), ("logit_bias", MAX_LOGIT_BIAS)):
            if len(getattr(self, name)) > cap:
                raise ConfigError(f"{name} takes at most {cap} entries, got "
                                  f"{len(getattr(self, name))}")
        bad = {t: b for t, b in self.logit_bias.items() if t < 0 or not -100 <= b <= 100}
        if bad:
            raise ConfigError(f"logit_bias needs token ids >= 0 and biases in -100..100; got "
                              f"{dict(list(bad.items())[:3])}")

    @cached_property
    def stop_set(self) -> frozenset[int]:
        """stop_token_ids as a set, made once: the per-step stop check is one lookup."""
        return frozenset(self.stop_token_ids)

    @cached_property
    def stop_tensor(self) -> Any:
        """stop_token_ids as a torch tensor, made once per request (the min_tokens mask)."""
        import torch
        return torch.tensor(self.stop_token_ids, dtype=torch.long)

    @cached_property
    def bias_tensors(self) -> tuple[Any, Any]:
        """logit_bias as (ids, biases) torch tensors, made once per request."""
        import torch
        ids = torch.tensor(list(self.logit_bias), dtype=torch.long)
        return ids, torch.tensor(list(self.logit_bias.values()), dtype=torch.float32)

    @property
    def needs_logits(self) -> bool:
        """Whether the request needs a model's logits beyond picking a token (an engine without
        them refuses it)."""
        return (self.logprobs is not None or self.prompt_logprobs is not None
                or bool(self.logit_bias) or self.presence_penalty != 0
                or self.frequency_penalty != 0 or self.repetition_penalty != 1)
