"""Typed configuration of a transfer engine."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpool.busypoll import check_window_us
from kvpool.errors import ConfigError
from kvpool.token import env_token

PROTOCOLS = ("auto", "tcp", "shm")


@dataclass(frozen=True)
class TransferConfig:
    host: str = "127.0.0.1"
    """Address the engine listens on and advertises; 127.0.0.1 unless told otherwise."""
    port: int = 0
    """TCP port of the engine's listener; 0 picks a free one."""
    metadata: str = "P2PHANDSHAKE"
    """Segment directory: "P2PHANDSHAKE", "http://h:p/metadata", "etcd://h:p" or bare "h:p" (etcd)."""
    protocol: str = "auto"
    """"auto" uses shm for same-host peers' shared buffers and tcp otherwise; "tcp" never uses shm;
    "shm" never moves data over tcp: a request that cannot go through shm fails (peers are still
    looked up, and P2P handshakes made, over tcp)."""
    token: str | None = field(default_factory=env_token, repr=False)
    """Shared secret checked at the connection handshake (default: $KVPOOL_TOKEN)."""
    timeout_s: float = 10.0
    """A request to a peer that does not answer fails after this long (never hangs)."""
    connect_timeout_s: float = 3.0
    """Bound on establishing a connection to a peer."""
    connections_per_peer: int = 4
    """Size of the TCP connection pool to each peer; large requests are spread across it."""
    slice_bytes: int = 1 << 20
    """Requests larger than this are cut into slices that travel on different connections.
    1 MiB: with busy polling a 1 MiB request moves faster as one frame in the caller's thread
    (3.1-3.4 GB/s) than as two 512 KiB slices (2.1-3.8 GB/s), and 8 MiB ones are no slower;
    before busy polling two slices won (alternating rounds, docs/perf.md)."""
    frame_bytes: int = 1 << 20
    """Small requests to one peer are coalesced into frames of up to this many payload bytes."""
    small_frame_bytes: int = 4 << 20
    """...and a frame of only requests under frame_bytes / 4 into frames of up to this many:
    a batch of 32 x 64 KiB then goes as one frame in the caller's thread. As two 1 MiB frames
    the caller and a worker thread polled for their replies at once, fighting over the GIL:
    a put cost 100-470 us more CPU in four A/B runs of four, a get 115-420 us in four of
    five (docs/perf.md). Larger requests keep frame_bytes, except that a sync call's batch of
    at most this many bytes to one peer is one frame whatever its sizes (4 x 1 MiB: puts 2.4
    -> 3.0 GB/s, gets 2.7 -> 4.0); 16 x 1 MiB in 4 MiB frames was no cheaper and at times
    slower."""
    frame_requests: int = 512
    """...and at most this many descriptors per frame (sendmsg's iovec limit is 1024)."""
    handshake_timeout_s: float = 10.0
    """The listener drops a connection whose whole handshake took longer (however it trickles)."""
    max_connections_per_address: int = 256
    """The listener closes connections from one remote address beyond this many at once. Every
    engine on this host connects from 127.0.0.1, each with up to `connections_per_peer`
    pooled connections, hence more than 64."""
    idle_timeout_s: float | None = None
    """The listener closes an authenticated connection silent this long between frames
    (initiators reconnect on their next frame); None keeps idle connections open."""
    reply_poll_us: int = 200
    """An initiator waiting for a reply polls its socket this long before blocking, while
    replies come that fast (kvpool.busypoll: a blocked process costs a wake-up, ~35 us per
    hop on a VM); 0 always blocks."""
    request_poll_us: int = 300
    """The listener's thread for a connection polls this long for the next frame before
    blocking, while frames on it come that fast (a store get's read follows its master
    lookup by ~100-200 us); an idle connection never polls. 0 always blocks."""

    def __post_init__(self) -> None:
        if self.protocol not in PROTOCOLS:
            raise ConfigError(f"protocol must be one of {PROTOCOLS}, got {self.protocol!r}")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be in 0..65535, got {self.port}")
        if self.timeout_s <= 0 or self.connect_timeout_s <= 0:
            raise ConfigError("timeouts must be > 0 seconds")
        if not 1 <= self.connections_per_peer <= 64:
            raise ConfigError(f"connections_per_peer must be in 1..64, got {self.connections_per_peer}")
        if self.slice_bytes < 4096 or self.frame_bytes < 4096:
            raise ConfigError("slice_bytes and frame_bytes must be >= 4096")
        if self.small_frame_bytes < self.frame_bytes:
            raise ConfigError("small_frame_bytes must be >= frame_bytes")
        if not 1 <= self.frame_requests <= 1000:
            raise ConfigError(f"frame_requests must be in 1..1000, got {self.frame_requests}")
        if self.idle_timeout_s is not None and self.idle_timeout_s <= 0:
            raise ConfigError(f"idle_timeout_s must be > 0 or None, got {self.idle_timeout_s}")
        for name in ("reply_poll_us", "request_poll_us"):
            check_window_us(name, getattr(self, name))
        if self.handshake_timeout_s <= 0:
            raise ConfigError(f"handshake_timeout_s must be > 0, got {self.handshake_timeout_s}")
        if not 1 <= self.max_connections_per_address <= 65536:
            raise ConfigError("max_connections_per_address must be in 1..65536, "
                              f"got {self.max_connections_per_address}")
