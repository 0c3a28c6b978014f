"""Resource limits of the master's RPC server (typed, frozen; one source of defaults)."""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.errors import ConfigError


@dataclass(frozen=True)
class RpcLimits:
    handshake_timeout_s: float = 5.0
    """A connection to a master with a token must finish the whole handshake within this
    time of being accepted, or it is closed."""
    idle_timeout_s: float = 600.0
    """An authenticated connection that neither sends nor takes bytes for this long is
    closed (clients reconnect on their next call)."""
    max_connections: int = 1024
    """Connections served at once; at the limit a new one replaces the oldest handshake or
    the longest idle connection, and is closed at once when every connection is busy."""
    max_handshakes: int = 128
    """Connections still in the handshake at once (part of max_connections); at the limit a
    new one replaces the oldest."""
    accept_backoff_s: float = 0.5
    """When accept() fails for want of descriptors or memory, the listener rests this long."""

    def __post_init__(self) -> None:
        for name in ("handshake_timeout_s", "idle_timeout_s", "accept_backoff_s"):
            value = getattr(self, name)
            if not 0 < value <= 86400:
                raise ConfigError(f"{name} must be in (0, 86400] seconds, got {value}")
        if not 1 <= self.max_connections <= 1 << 20:
            raise ConfigError(f"max_connections must be in [1, 2**20], got "
                              f"{self.max_connections}")
        if not 1 <= self.max_handshakes <= self.max_connections:
            raise ConfigError(f"max_handshakes must be in [1, max_connections], got "
                              f"{self.max_handshakes}")
