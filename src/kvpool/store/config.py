"""Typed, frozen configuration of the store: one source of defaults for CLI, library and docs."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpool.errors import ConfigError

MAX_KEY_BYTES = 4096
"""Longest key accepted, in UTF-8 bytes."""


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


@dataclass(frozen=True)
class MasterConfig:
    lease_ttl_s: float = 10.0
    """Read lease granted by a lookup; a leased object is neither evicted nor removed."""
    soft_pin_ttl_s: float = 1800.0
    """How long a soft pin protects an object from the first eviction pass."""
    high_watermark: float = 0.90
    """Eviction starts when used / capacity goes above this ratio."""
    eviction_ratio: float = 0.05
    """Fraction of total capacity one eviction round tries to free."""
    client_ttl_s: float = 10.0
    """A client silent for this long is considered dead; its segments are unmounted."""
    put_discard_timeout_s: float = 30.0
    """A put started but neither ended nor revoked within this time is discarded."""
    put_release_timeout_s: float = 600.0
    """Memory of a put the master discarded is reused only this long after, in case its
    writer is still copying (Mooncake's put_start_release_timeout_sec)."""
    allocation_strategy: str = "random"
    """Replica placement: 'random' or 'free_ratio_first'."""
    eviction_policy: str = "lru"
    """Name of the eviction policy in the registry of kvpool.store.master.eviction."""
    max_batch: int = 65536
    """Most keys in one batched request."""
    max_replicas: int = 8
    max_object_bytes: int = 1 << 40
    alignment: int = 64
    """Every allocation starts on a multiple of this many bytes."""
    seed: int | None = None
    """Seed of the random placement; None draws one from the OS."""

    def __post_init__(self) -> None:
        _check(self.lease_ttl_s > 0, f"lease_ttl_s must be > 0, got {self.lease_ttl_s}")
        _check(self.soft_pin_ttl_s > 0, f"soft_pin_ttl_s must be > 0, got {self.soft_pin_ttl_s}")
        _check(0 < self.high_watermark <= 1.0,
               f"high_watermark must be in (0, 1], got {self.high_watermark}")
        _check(0 < self.eviction_ratio <= 1.0,
               f"eviction_ratio must be in (0, 1], got {self.eviction_ratio}")
        _check(self.client_ttl_s > 0, f"client_ttl_s must be > 0, got {self.client_ttl_s}")
        _check(self.put_discard_timeout_s > 0,
               f"put_discard_timeout_s must be > 0, got {self.put_discard_timeout_s}")
        _check(self.put_release_timeout_s >= 0,
               f"put_release_timeout_s must be >= 0, got {self.put_release_timeout_s}")
        _check(self.allocation_strategy in ("random", "free_ratio_first"),
               f"allocation_strategy must be 'random' or 'free_ratio_first', "
               f"got {self.allocation_strategy!r}")
        _check(1 <= self.max_batch <= 1 << 20, f"max_batch out of range: {self.max_batch}")
        _check(1 <= self.max_replicas <= 64, f"max_replicas out of range: {self.max_replicas}")
        _check(self.max_object_bytes >= 1, "max_object_bytes must be >= 1")
        _check(self.alignment >= 1 and self.alignment & (self.alignment - 1) == 0,
               f"alignment must be a power of two, got {self.alignment}")


@dataclass(frozen=True)
class ReplicateConfig:
    """How one put is placed: Mooncake's ReplicateConfig fields."""

    replica_num: int = 1
    with_hard_pin: bool = False
    with_soft_pin: bool = False
    preferred_segment: str = ""
    """Endpoint ('host:port') or segment id to place the first replica on, when it has room."""
    preferred_segments: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        _check(1 <= self.replica_num <= 64, f"replica_num must be in [1, 64], got {self.replica_num}")
