"""Settings of the conductor. Values the papers leave open are chosen here and documented in
docs/conductor.md; every one is a field so experiments can sweep it."""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.errors import ConfigError


@dataclass(frozen=True, slots=True)
class ConductorConfig:
    prefill_policy: str = "kvcache_centric"
    """Name in PREFILL_POLICIES: random, round_robin, load_balance, cache_aware, kvcache_centric."""
    admission: str = "early_rejection"
    """Name in ADMISSION_POLICIES: none, early_rejection, early_rejection_predicted."""
    ttft_slo_s: float = 30.0
    """TTFT limit l_ttft ([F] 5.1: 30 s)."""
    tbt_slo_s: float = 0.1
    """TBT limit l_tbt ([F] Threshold I: 100 ms)."""
    balancing_threshold: float = 1.2
    """kvcache_balancing_threshold of Algorithm 1: fetch a remote prefix (and replicate it) when
    best_prefix_len / local_prefix_len >= this; the paper tunes it by hand and gives no value."""
    block_size: int = 512
    """Tokens per block hash (the released traces use 512)."""
    decode_horizon_s: float = 10.0
    """t_d of [A] 7.4: the uniform decode duration assumed by system-level prediction;
    the conversation trace's mean output (343 tokens) at ~30 ms per step."""
    seed: int = 0
    """Seed of the random policy."""
    ttft_slo_relative: float | None = None
    """With a value k: each request's TTFT limit is k x its own unloaded TTFT (its transfer and
    prefill with no queue; the relative SLO of the arXiv paper, section 2) instead of
    `ttft_slo_s`, so a long prompt is never refused for its own length."""

    def __post_init__(self) -> None:
        if self.ttft_slo_relative is not None and self.ttft_slo_relative <= 1:
            raise ConfigError(f"ttft_slo_relative must be > 1, got {self.ttft_slo_relative}")
        if self.ttft_slo_s <= 0 or self.tbt_slo_s <= 0:
            raise ConfigError(
                f"SLOs must be > 0, got ttft_slo_s={self.ttft_slo_s} tbt_slo_s={self.tbt_slo_s}")
        if self.balancing_threshold < 1.0:
            raise ConfigError(
                f"balancing_threshold is a ratio of prefix lengths and must be >= 1, "
                f"got {self.balancing_threshold}")
        if self.block_size <= 0:
            raise ConfigError(f"block_size must be > 0, got {self.block_size}")
        if self.decode_horizon_s <= 0:
            raise ConfigError(f"decode_horizon_s must be > 0, got {self.decode_horizon_s}")
