"""One HA master process: stand by until elected, then replay the shared state directory
and serve until stopped or deposed.

    standby --(wins the leader key: term N)--> replay STATE_DIR --> serve, renewing the lease
       ^                                                              |
       +------------ exit code 3 (a supervisor restarts it) <--- lease lost

A deposed master stops serving at once (every request is refused from its own lease
deadline on, see election.py) and exits: its in-memory tables may be stale, and rejoining
as a standby from a clean process is the simple way back.
"""

from __future__ import annotations

import threading
import time

from kvpool.errors import ConfigError
from kvpool.log import get_logger
from kvpool.store.config import MasterConfig
from kvpool.store.master.election import LeaderElection, advertised, role_metrics
from kvpool.store.master.http_thread import HttpServerThread
from kvpool.store.master.persist import PersistConfig
from kvpool.store.master.server import MasterServer, MasterServerConfig, tune_gc_for_master
from kvpool.store.wire.leader import Etcd, parse_endpoints

log = get_logger("store.ha")
DEPOSED_EXIT = 3


class _RoleCollector:
    def __init__(self, election: LeaderElection) -> None:
        self.election = election

    def collect(self):  # type: ignore[no-untyped-def]
        return role_metrics(self.election)


def _standby_admin(election: LeaderElection, cfg: MasterServerConfig) -> HttpServerThread:
    """/health and /metrics (role and term) on the admin port while standing by."""
    from fastapi import FastAPI, Response
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

    registry = CollectorRegistry()
    registry.register(_RoleCollector(election))  # type: ignore[arg-type]
    app = FastAPI()
    app.get("/health")(lambda: {"status": "standby", "leader_key": election.key})
    app.get("/metrics")(lambda: Response(generate_latest(registry),
                                         media_type=CONTENT_TYPE_LATEST))
    server = HttpServerThread(app, cfg.host, cfg.admin_port, cfg.http_limits)
    server.start()
    return server


def run_ha_master(server_cfg: MasterServerConfig, config: MasterConfig,
                  persist: PersistConfig, endpoints: str | None, ttl_s: int,
                  cluster_id: str, stop: threading.Event) -> int:
    """Run until `stop` (0) or until the lease is lost (DEPOSED_EXIT)."""
    if not endpoints:
        raise ConfigError("--enable_ha needs --etcd_endpoints host:port[;host:port...]")
    if server_cfg.rpc_port == 0:
        raise ConfigError("--enable_ha needs a fixed --rpc_port: it is published in etcd "
                          "before the port is bound")
    if not 2 <= ttl_s <= 600:
        raise ConfigError(f"--ha-lease-ttl must be in 2..600 s, got {ttl_s}")
    election = LeaderElection(Etcd(parse_endpoints(endpoints)),
                              advertised(server_cfg.host, server_cfg.rpc_port), ttl_s,
                              cluster_id)
    standby_admin = _standby_admin(election, server_cfg)
    print(f"kvpool master standby: {election.address} waiting for the leader key",
          flush=True)
    waited = time.monotonic()
    try:
        term = election.campaign(stop)
    finally:
        standby_admin.stop()  # the leader's own admin server takes the port
    if term is None:
        return 0
    lost = threading.Event()

    def keep() -> None:
        election.keep(stop)
        lost.set()

    keeper = threading.Thread(target=keep, daemon=True, name="kvpool-ha-lease")
    keeper.start()
    master = MasterServer(server_cfg, config, persist=persist, term=term)
    assert master.journal is not None
    master.journal.fence = election.is_leader
    master.metrics.registry.register(_RoleCollector(election))  # type: ignore[arg-type]
    master.start()
    tune_gc_for_master()
    log.warning("leader for term %d after %.1fs as standby", term, time.monotonic() - waited)
    print(f"kvpool master ready: rpc {master.address} admin {master.admin_port} leader "
          f"term {term}", flush=True)
    while not stop.is_set() and not lost.is_set():
        stop.wait(0.1)
    master.stop()
    if lost.is_set() and not stop.is_set():
        log.error("lost the leader lease (term %d); stopped serving", term)
        return DEPOSED_EXIT
    election.resign()
    return 0
