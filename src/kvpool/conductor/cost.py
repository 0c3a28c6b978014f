"""Cost model: prefill, decode-step and KV-transfer time estimates.

Defaults are calibrated to the papers' LLaMA-70B on 8xA800 figures (see docs/conductor.md):

- prefill  t = base + linear*(n - p) + quadratic*(n^2 - p^2)   joint fit of [F] Fig.14, 0% and
  95% cached points (PAPER.md 4.3); n = prompt tokens, p = reused prefix tokens.
- decode   t = base + per_seq*batch + per_token*context_tokens   [F] Fig.14 gives 26.5 ms/token at
  8k and 30.8 ms at 128k (slope 3.58e-8 s per context token); [A] Fig.2 gives +1.9% of the
  single-request step per extra request in the batch at 8k context.
- transfer t = latency + bytes / (bandwidth_gbps * 1e9 / 8 * efficiency); 320 KiB of KV per token
  ([F] 5.3); efficiency 0.87 reproduces the Transfer Engine's 87 GB/s on 4x200 Gbps ([F] 5.4.1).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from kvpool.conductor.cost_fit import PLAIN, fit_terms
from kvpool.errors import ConfigError, InvalidArgument


@dataclass(frozen=True, slots=True)
class CostModel:
    prefill_base_s: float = 0.156
    """Fixed cost of one prefill (scheduling, launch, sampling of the first token)."""
    prefill_linear_s: float = 1.066e-4
    """Seconds per newly computed token (MLP and projections)."""
    prefill_quadratic_s: float = 7.81e-10
    """Seconds per (n^2 - p^2) token pair (attention over the whole context)."""
    decode_base_s: float = 0.0260
    """One decode step with an empty batch: reading the weights once."""
    decode_per_seq_s: float = 2.16e-4
    """Extra step time per sequence in the batch."""
    decode_per_token_s: float = 3.58e-8
    """Extra step time per KV token held by the batch (attention reads)."""
    kv_bytes_per_token: int = 327_680
    """LLaMA-70B with GQA 8, bf16: 80 layers * 2 * 1024 * 2 bytes = 320 KiB."""
    bandwidth_gbps: float = 800.0
    """Link bandwidth of one node (4 x 200 Gbps in [F])."""
    link_efficiency: float = 0.87
    """Achieved share of the line rate (87 GB/s of 100 GB/s raw in [F] Fig.12)."""
    transfer_latency_s: float = 0.0
    """Fixed cost of one transfer (connection setup, metadata lookup)."""
    load_s_per_token: float = 3.5e-6
    """DRAM -> GPU load of a cached token; half of [F] Fig.14's 7 us/token transfer+load."""
    decode_join_s: float = 0.0
    """Extra time of a decode step per request joining the batch with KV transferred from a
    prefill instance (0 in the papers' microbenchmarks; fitted by `kvpool sim calibrate`)."""

    def __post_init__(self) -> None:
        for name in ("prefill_base_s", "prefill_linear_s", "prefill_quadratic_s",
                     "decode_base_s", "decode_per_seq_s", "decode_per_token_s",
                     "transfer_latency_s", "load_s_per_token", "decode_join_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"CostModel.{name} must be >= 0, got {getattr(self, name)}")
        if self.kv_bytes_per_token <= 0:
            raise ConfigError(f"kv_bytes_per_token must be > 0, got {self.kv_bytes_per_token}")
        if self.bandwidth_gbps <= 0:
            raise ConfigError(f"bandwidth_gbps must be > 0, got {self.bandwidth_gbps}")
        if not 0 < self.link_efficiency <= 1:
            raise ConfigError(f"link_efficiency must be in (0, 1], got {self.link_efficiency}")

    @property
    def bytes_per_s(self) -> float:
        return self.bandwidth_gbps * 1e9 / 8 * self.link_efficiency

    def prefill_s(self, input_len: int, prefix_len: int = 0) -> float:
        """Compute time of a prefill of `input_len` tokens of which `prefix_len` are reused."""
        if input_len < 0 or not 0 <= prefix_len <= input_len:
            raise InvalidArgument(
                f"need 0 <= prefix_len <= input_len, got input_len={input_len} "
                f"prefix_len={prefix_len}")
        new = input_len - prefix_len
        pairs = input_len * input_len - prefix_len * prefix_len
        return self.prefill_base_s + self.prefill_linear_s * new + self.prefill_quadratic_s * pairs

    def prefill_with_load_s(self, input_len: int, prefix_len: int = 0) -> float:
        """Prefill with the prefix loaded layer by layer: max(compute, load) ([A] 5.2)."""
        return max(self.prefill_s(input_len, prefix_len), prefix_len * self.load_s_per_token)

    def proven_prefill_s(self, input_len: int, prefix_len: int = 0) -> float:
        """The least prefill time (with loading) this model is sure of, which admission may
        hold against a request as unreachable: for coefficients given as they are (the
        papers', a file's) the prediction itself; a model learned from measurements proves
        only what was measured (conductor/measured.py)."""
        return self.prefill_with_load_s(input_len, prefix_len)

    def decode_step_s(self, batch_size: int, context_tokens: int) -> float:
        """Time of one continuous-batching step over `batch_size` sequences."""
        if batch_size < 0 or context_tokens < 0:
            raise InvalidArgument(
                f"batch_size and context_tokens must be >= 0, got {batch_size}, {context_tokens}")
        return (self.decode_base_s + self.decode_per_seq_s * batch_size
                + self.decode_per_token_s * context_tokens)

    def transfer_s(self, num_bytes: int) -> float:
        if num_bytes < 0:
            raise InvalidArgument(f"num_bytes must be >= 0, got {num_bytes}")
        if num_bytes == 0:
            return 0.0
        return self.transfer_latency_s + num_bytes / self.bytes_per_s

    def kv_transfer_s(self, num_tokens: int) -> float:
        return self.transfer_s(num_tokens * self.kv_bytes_per_token)

    def with_bandwidth(self, gbps: float) -> CostModel:
        return replace(self, bandwidth_gbps=gbps)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CostModel:
        """Defaults for missing fields; InvalidArgument for unknown ones."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise InvalidArgument(f"unknown CostModel fields {unknown}; known: {sorted(known)}")
        return cls(**data)


def load_cost_model(path: Path | str) -> CostModel:
    """A CostModel from a JSON object file (as written by `kvpool sim fit`)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise InvalidArgument(f"cannot read a cost model from {path}: {exc}") from None
    if not isinstance(data, dict):
        raise InvalidArgument(f"{path}: a cost model is a JSON object")
    return CostModel.from_dict(data)


def fit_prefill(samples: Iterable[tuple[int, int, float]],
                base: CostModel | None = None) -> CostModel:
    """Non-negative least-squares fit of the prefill coefficients to measured (input_len,
    prefix_len, seconds), each coefficient bounded by what the samples allow
    (`cost_fit.fit_terms` with every sample weighing the same and none left out).

    Returns `base` (default: `CostModel()`) with the three prefill coefficients replaced.
    Raises InvalidArgument for fewer than three samples or an impossible sample.
    """
    fit = fit_terms(list(samples), PLAIN)
    return replace(base or CostModel(), prefill_base_s=fit.base_s,
                   prefill_linear_s=fit.linear_s, prefill_quadratic_s=fit.quadratic_s)
