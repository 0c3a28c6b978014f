"""Configuration of a store client (library or store-node daemon)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpool.busypoll import check_window_us
from kvpool.errors import ConfigError
from kvpool.token import env_token

DEFAULT_LOCAL_BUFFER = 64 << 20


@dataclass(frozen=True)
class ClientConfig:
    master: str = "127.0.0.1:50051"
    """Master RPC address, HOST:PORT."""
    local_hostname: str = "127.0.0.1"
    """Host the transfer engine listens on and advertises."""
    te_port: int = 0
    """Transfer-engine port; 0 picks a free one."""
    metadata: str = "P2PHANDSHAKE"
    """Segment directory for the transfer engine."""
    protocol: str = "auto"
    """Transport: auto (shm on the same host, else tcp), tcp or shm."""
    global_segment_size: int = 0
    """Bytes of DRAM this process contributes to the pool (0 = pure client)."""
    local_buffer_size: int = DEFAULT_LOCAL_BUFFER
    """Staging buffer for the bytes API (put/get of Python bytes)."""
    rpc_timeout_s: float = 5.0
    reply_poll_us: int = 200
    """A wait for a reply (the master's, or a node's in a transfer) polls this long before
    blocking, while replies come that fast (kvpool.busypoll: a blocked process costs a
    wake-up, ~35 us per hop on a VM); 0 always blocks."""
    request_poll_us: int = 300
    """With memory in the pool: the transfer listener's thread for a connection polls this
    long for the next request before blocking, while requests on it come that fast (a get's
    read follows its master lookup by ~100-200 us); an idle connection never polls."""
    heartbeat_interval_s: float = 1.0
    transfer_timeout_s: float = 10.0
    close_timeout_s: float = 3.0
    """Upper bound on `close()`: unmounting is given up once this has passed, or at the first
    failure to reach the master (it drops our segments when our heartbeats stop anyway)."""
    token: str | None = field(default_factory=env_token,
                               repr=False)
    """Shared secret for the master's RPC and the transfer engine (default: $KVPOOL_TOKEN)."""
    verify_checksums: bool = True
    """Hash what every read received and refuse bytes that do not match the checksum the
    writer recorded (CHECKSUM_MISMATCH, after trying the other replicas)."""
    write_checksums: bool = True
    """Hash every object's bytes on put and record the value with PUT_END; objects put
    without one are never verified."""
    client_id: str = ""
    """Empty: derived from the transfer-engine endpoint and the process id."""
    rpc_batch_keys: int = 4096
    """Keys per master RPC: larger batches are split into several calls (keep it at or
    below the master's max_batch)."""
    reserved_puts: bool = True
    """Single-key puts of up to RESERVE_MAX_BYTES with the default ReplicateConfig write
    into space reserved ahead and publish with one PUT_COMMIT (which also reserves for the
    next put of that size): one master round trip per put instead of two."""
    early_reads: bool = True
    """Single-key gets of objects up to EARLY_READ_MAX_BYTES that this client placed with a
    single-key put or found with a single-key lookup lately read the bytes from that replica
    while the master answers a new lookup, and serve them only when that answer vouches for
    them (same replica, size and checksum; store/client/early.py): one master round trip's
    wait less per get. Needs verify_checksums."""
    lease_retries: int = 2
    """Times a get looks up again and rereads the objects whose read lease ended before their
    bytes were in (a copy loaded from disk has a short lease, which a slow moment outlives);
    within rpc_timeout_s of the first lookup. 0 answers LEASE_EXPIRED at once."""

    def __post_init__(self) -> None:
        if self.global_segment_size < 0 or self.local_buffer_size < 0:
            raise ConfigError("global_segment_size and local_buffer_size must be >= 0, got "
                              f"{self.global_segment_size} and {self.local_buffer_size}")
        if not 1 <= self.rpc_batch_keys <= 1 << 20:
            raise ConfigError(f"rpc_batch_keys must be in [1, 2**20], got {self.rpc_batch_keys}")
        for name in ("reply_poll_us", "request_poll_us"):
            check_window_us(name, getattr(self, name))
        if not 0 <= self.lease_retries <= 16:
            raise ConfigError(f"lease_retries must be in 0..16, got {self.lease_retries}")
        if not 0 <= self.te_port <= 65535:
            raise ConfigError(f"te_port must be in 0..65535, got {self.te_port}")
        for name in ("rpc_timeout_s", "heartbeat_interval_s", "transfer_timeout_s",
                     "close_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if ":" not in self.master:
            raise ConfigError(f"master must be HOST:PORT, got {self.master!r}")
