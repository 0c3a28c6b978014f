"""The master process: RPC server, admin HTTP server and (optionally) the HTTP metadata
server around one MasterCore."""

from __future__ import annotations

import gc
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvpool.busypoll import check_window_us
from kvpool.clock import SYSTEM_CLOCK, Clock
from kvpool.errors import ConfigError
from kvpool.kvevents.pool import PoolEventsConfig
from kvpool.log import get_logger
from kvpool.metadata.http_serving import HttpLimits
from kvpool.store.config import MasterConfig
from kvpool.store.master.admin import create_admin_app
from kvpool.store.master.core import MasterCore
from kvpool.store.master.http_thread import HttpServerThread
from kvpool.store.master.metrics import MasterMetrics
from kvpool.store.master.persist import Journal, PersistConfig, PersistentService
from kvpool.store.master.rpc_limits import RpcLimits
from kvpool.store.master.rpc_server import RpcServer
from kvpool.store.master.service import MasterService
from kvpool.token import env_token

if TYPE_CHECKING:
    from kvpool.kvevents.publisher import KvEventPublisher

log = get_logger("store.master")


@dataclass(frozen=True)
class MasterServerConfig:
    host: str = "127.0.0.1"
    rpc_port: int = 50051
    """Control-plane RPC (0 picks a free port)."""
    admin_port: int = 9003
    """Health, Prometheus metrics and inspection."""
    metadata_port: int = 8080
    """Embedded HTTP metadata server (when enabled)."""
    enable_http_metadata: bool = True
    tick_interval_s: float = 0.1
    """How often timeouts and watermark eviction are checked."""
    token: str | None = field(default_factory=env_token,
                              repr=False)
    """Shared secret (default: $KVPOOL_TOKEN): RPC connections prove they know it, metadata
    writes and admin listings must carry it."""
    http_limits: HttpLimits = field(default_factory=HttpLimits)
    """Concurrency and idle limits of the admin and embedded metadata HTTP servers."""
    rpc_limits: RpcLimits = field(default_factory=RpcLimits)
    """Handshake and idle timeouts, connection caps of the RPC server."""
    health_stall_s: float = 5.0
    """/health answers 503 when the RPC loop has not turned for this long."""
    request_poll_us: int = 300
    """After serving, the RPC loop polls for the next request this long before blocking,
    while requests come that fast (kvpool.busypoll: a blocked process costs a wake-up,
    ~35 us on a VM); an idle master never polls. 0 always blocks."""
    kv_events: PoolEventsConfig | None = None
    """Publish the pool's blocks as vLLM KV events (kvpool.kvevents.pool); None: off."""

    def __post_init__(self) -> None:
        for name in ("rpc_port", "admin_port", "metadata_port"):
            value = getattr(self, name)
            if not 0 <= value <= 65535:
                raise ConfigError(f"{name} must be in 0..65535, got {value}")
        if not 0.001 <= self.tick_interval_s <= 10:
            raise ConfigError(f"tick_interval_s must be in [0.001, 10], got "
                              f"{self.tick_interval_s}")
        check_window_us("request_poll_us", self.request_poll_us)
        if not self.tick_interval_s < self.health_stall_s <= 3600:
            raise ConfigError(f"health_stall_s must be in (tick_interval_s, 3600], got "
                              f"{self.health_stall_s}")


def tune_gc_for_master() -> tuple[int, int, int]:
    """Make Python's cyclic collector rare in a master process: its tables hold millions of
    small objects without cycles, and frequent full collections over them cost more than
    the requests (about 1.5x put_start throughput at a million keys). Returns the previous
    thresholds. Called by `kvpool master`; library users of MasterServer decide themselves."""
    previous = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(200_000, 50, 1000)
    return previous


class MasterServer:
    """`start()` binds every port and returns; `.rpc_port` / `.admin_port` are then real."""

    def __init__(self, server: MasterServerConfig | None = None,
                 config: MasterConfig | None = None, clock: Clock = SYSTEM_CLOCK,
                 persist: PersistConfig | None = None, term: int = 0) -> None:
        """With `persist`, the state directory is replayed here (objects come back as
        their nodes mount again) and every acknowledged change is logged there."""
        self.server_config = server or MasterServerConfig()
        self.core = MasterCore(config or MasterConfig(), clock)
        self.lock = threading.Lock()
        self.metrics = MasterMetrics(self.core, self.lock)
        self.journal: Journal | None = None
        if persist is None:
            self.service = MasterService(self.core, self.metrics.observe)
        else:
            self.journal = Journal(persist, self.core, term)
            self.core.log_to(self.journal)
            self.service = PersistentService(self.core, self.journal, self.metrics.observe)
        self.metrics.watch_key_errors(self.service.key_errors)
        self._rpc: RpcServer | None = None
        self._admin: HttpServerThread | None = None
        self._metadata: Any = None
        self._kv_events: KvEventPublisher | None = None

    @property
    def rpc_port(self) -> int:
        assert self._rpc is not None, "start() first"
        return self._rpc.port

    @property
    def admin_port(self) -> int:
        assert self._admin is not None, "start() first"
        return self._admin.port

    @property
    def address(self) -> str:
        return f"{self.server_config.host}:{self.rpc_port}"

    def start(self) -> MasterServer:
        """Bind and start every server. On failure (StoreError or MetadataError naming the
        port, e.g. one already in use) whatever was started is stopped and closed again."""
        try:
            self._start_servers()
        except BaseException:
            self.stop()
            raise
        return self

    def _start_servers(self) -> None:
        cfg = self.server_config
        self._rpc = rpc = RpcServer(self.service, cfg.host, cfg.rpc_port, self.lock,
                                    cfg.tick_interval_s, cfg.token, cfg.rpc_limits,
                                    cfg.request_poll_us, self.core.clock)
        app = create_admin_app(self.core, self.lock, self.metrics,
                               lambda: rpc.stall_problem(cfg.health_stall_s), cfg.token)
        self._admin = HttpServerThread(app, cfg.host, cfg.admin_port, cfg.http_limits)
        self._admin.start()
        if cfg.enable_http_metadata:
            from kvpool.metadata.server import MetadataServer
            self._metadata = MetadataServer(cfg.host, cfg.metadata_port,
                                            http_limits=cfg.http_limits, token=cfg.token)
            self._metadata.start()
        if cfg.kv_events is not None:
            self._start_kv_events(cfg.kv_events)
        rpc.start()
        log.info("master listening: rpc %s:%d admin %d metadata %s", cfg.host, rpc.port,
                 self._admin.port, self._metadata.port if self._metadata else "off")

    def _start_kv_events(self, cfg: PoolEventsConfig) -> None:
        from kvpool.kvevents.pool import PoolEventTranslator
        from kvpool.kvevents.publisher import KvEventPublisher

        self._kv_events = pub = KvEventPublisher(cfg.endpoint, cfg.replay_endpoint, cfg.topic,
                                                 cfg.buffer_steps)
        from kvpool.store.master.pool_events import media_of, report_change

        sink = PoolEventTranslator(pub.submit, cfg.int_hashes, cfg.block_size)
        with self.lock:  # what the table holds already (a replayed journal) is announced first
            for obj in self.core.objects.values():
                report_change(sink, obj.key, set(), media_of(obj.replicas))
            self.core.objects.report_to(sink)
        log.info("pool KV events: %s, replay %s, topic %r", pub.endpoint,
                 pub.replay_endpoint or "off", cfg.topic)

    @property
    def kv_events_replay_endpoint(self) -> str | None:
        """The bound replay endpoint of the pool's KV events (None: not published)."""
        return self._kv_events.replay_endpoint if self._kv_events is not None else None

    def stop(self) -> None:
        if self._rpc is not None:
            self._rpc.stop()
        if self._kv_events is not None:
            self._kv_events.close()
        if self._admin is not None:
            self._admin.stop()
        if self._metadata is not None:
            self._metadata.stop()
        if self.journal is not None:
            with self.lock:
                self.journal.close()

    def __enter__(self) -> MasterServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
