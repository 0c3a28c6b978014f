"""`kvpool master` flags for persistence and high availability, and the run loop they need.

    kvpool master --state-dir DIR [--persist-fsync always|interval|never] [--recover-partial]
    kvpool master --enable_ha=true --etcd_endpoints='h1:2379;h2:2379' [--state-dir SHARED_DIR]

Without these flags `kvpool master` runs as before (master_cmd.run); with any of them,
`run_persistent` takes over.
"""

from __future__ import annotations

import argparse
import signal
import threading

from kvpool.errors import ConfigError, KvpoolError
from kvpool.launch.ready import announce_ready
from kvpool.log import get_logger
from kvpool.store.config import MasterConfig
from kvpool.store.master.persist import FSYNC_POLICIES, PersistConfig
from kvpool.store.master.server import MasterServer, MasterServerConfig, tune_gc_for_master

log = get_logger("cli.master")
_P = PersistConfig("")


def parse_bool(value: str) -> bool:
    """Mooncake's boolean flag values (`--enable_ha=true`)."""
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")


def add_ha_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("persistence and high availability")
    g.add_argument("--state-dir", "--state_dir", dest="state_dir", default=None,
                   help="keep a snapshot and log of every stored object here; a master "
                        "restarted on it serves them again (with --enable_ha: shared by "
                        "the masters; without it the journal is kept in etcd)")
    g.add_argument("--persist-fsync", dest="persist_fsync", choices=FSYNC_POLICIES,
                   default=_P.fsync, help="when logged records reach the disk "
                   "(default: before each reply)")
    g.add_argument("--persist-fsync-interval", dest="persist_fsync_interval", type=float,
                   default=_P.fsync_interval_s, help="seconds, for --persist-fsync interval")
    g.add_argument("--recover-partial", dest="recover_partial", action="store_true",
                   help="start even when the snapshot that later logs depend on is missing "
                        "or damaged, keeping what is left (without it such a master refuses "
                        "to start, exit code 2)")
    g.add_argument("--recovery-grace", dest="recovery_grace", type=float,
                   default=_P.recovery_grace_s, help="seconds recovered segments wait for "
                   "their nodes to mount again")
    g.add_argument("--enable_ha", "--enable-ha", dest="enable_ha", type=parse_bool, nargs="?",
                   const=True, default=False, help="elect one leader among masters via etcd")
    g.add_argument("--etcd_endpoints", "--etcd-endpoints", dest="etcd_endpoints",
                   default=None, help="etcd host:port list, ';' or ',' separated")
    g.add_argument("--ha-lease-ttl", dest="ha_lease_ttl", type=int, default=5,
                   help="leader lease in etcd, whole seconds (failover takes about this)")
    g.add_argument("--cluster_id", "--cluster-id", dest="cluster_id", default="kvpool",
                   help="names the leader key in etcd, so clusters can share one etcd")


def wants_persistence(args: argparse.Namespace) -> bool:
    return bool(args.state_dir or args.enable_ha)


def persist_config(args: argparse.Namespace) -> PersistConfig:
    """A state directory when given; else (with --enable_ha) the journal lives in etcd."""
    if args.enable_ha and not args.etcd_endpoints:
        raise ConfigError("--enable_ha needs --etcd_endpoints host:port[;host:port...]")
    etcd = "" if args.state_dir else args.etcd_endpoints
    return PersistConfig(args.state_dir or "", args.persist_fsync,
                         args.persist_fsync_interval, recovery_grace_s=args.recovery_grace,
                         etcd=etcd, cluster_id=args.cluster_id,
                         recover_partial=args.recover_partial)


def run_persistent(args: argparse.Namespace, server_cfg: MasterServerConfig,
                   config: MasterConfig) -> int:
    """Run a master with a state directory (and, with --enable_ha, under etcd leadership)
    until SIGTERM/SIGINT. The caller has built the configs and checked the bind address."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        persist = persist_config(args)
        if args.enable_ha:
            from kvpool.store.master.ha import run_ha_master
            return run_ha_master(server_cfg, config, persist, args.etcd_endpoints,
                                 args.ha_lease_ttl, args.cluster_id, stop)
        master = MasterServer(server_cfg, config, persist=persist).start()
        tune_gc_for_master()
    except (ConfigError, KvpoolError, OSError) as exc:
        log.error("%s", exc)
        return 2
    announce_ready(f"kvpool master ready: rpc {master.address} admin {master.admin_port} "
                   f"state {persist.state_dir}")
    stop.wait()
    master.stop()
    return 0
