"""`kvpool master`: the store's metadata master (RPC, admin HTTP, embedded HTTP metadata).

Mooncake's `mooncake_master` flag spellings are accepted as aliases, with Mooncake's units
(`--default_kv_lease_ttl` in ms, `--client_ttl` in s) and its defaults: RPC on 50051, admin
HTTP on 9003, no HTTP metadata server unless `--enable_http_metadata_server` (kvpool's own
`--metadata-port` turns it on). One difference, on purpose: without a token the master binds
127.0.0.1, not every interface; `--rpc_address` / `--metrics_host` /
`--http_metadata_server_host` (or `--host`) choose the address, and a non-loopback one needs
`--token` or `--insecure` (cli/security.py). The startup line says what is reachable from where.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from kvpool.cli import ha_flags
from kvpool.cli.security import add_security_args, bind_refusal, is_loopback
from kvpool.errors import ConfigError, KvpoolError
from kvpool.kvevents.pool import PoolEventsConfig
from kvpool.launch.ready import announce_ready
from kvpool.log import get_logger
from kvpool.store.config import MasterConfig
from kvpool.store.master.server import MasterServer, MasterServerConfig, tune_gc_for_master

log = get_logger("cli.master")
_DEF = MasterConfig()
_SRV = MasterServerConfig()

_UNIT_MS = {"ms": 1.0, "s": 1000.0, "m": 60_000.0, "h": 3_600_000.0}


def _duration_ms(value: str) -> float:
    """Milliseconds from '10000', '500ms', '10s', '5m' or '1h' (Mooncake's TTL flags)."""
    text = value.strip().lower()
    for unit in ("ms", "s", "m", "h"):
        if text.endswith(unit) and text[:-len(unit)].replace(".", "", 1).isdigit():
            return float(text[:-len(unit)]) * _UNIT_MS[unit]
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected milliseconds or a duration like 10s, got {value!r}") from None


ALL_INTERFACES = "0.0.0.0"
_ADDRESS_FLAGS = ("--host", "--rpc_address", "--metrics_host", "--http_metadata_server_host")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("master", help="run the KVCache store master")
    for flag in _ADDRESS_FLAGS:
        p.add_argument(flag, dest=f"addr_{flag.lstrip('-')}", default=None,
                       help="address to bind every server to (kvpool binds one address); "
                       "default 127.0.0.1, or 0.0.0.0 (as mooncake_master) with --token"
                       if flag == "--host" else "mooncake_master's spelling of --host")
    p.add_argument("--rpc-port", "--rpc_port", "--port", dest="rpc_port", type=int,
                   default=_SRV.rpc_port, help="control-plane RPC port (default 50051)")
    p.add_argument("--admin-port", "--metrics_port", "--metrics-port", dest="admin_port",
                   type=int, default=_SRV.admin_port, help="admin HTTP port (default 9003)")
    p.add_argument("--http_metadata_server_port", dest="metadata_port", type=int,
                   default=_SRV.metadata_port,
                   help="embedded HTTP metadata port (default 8080; see the next flag)")
    p.add_argument("--metadata-port", dest="kvpool_metadata_port", type=int, default=None,
                   help="serve HTTP metadata on this port (implies the next flag)")
    p.add_argument("--enable_http_metadata_server", "--http-metadata", dest="metadata",
                   type=ha_flags.parse_bool, nargs="?", const=True, default=None,
                   help="serve HTTP metadata (default off, as mooncake_master)")
    p.add_argument("--no-http-metadata", dest="metadata", action="store_false", default=None,
                   help="do not embed the HTTP metadata server")
    _add_object_args(p)
    _add_kv_events_args(p)
    add_security_args(p, "RPC clients must prove, and that metadata writes and admin "
                         "listings must carry")
    ha_flags.add_ha_args(p)
    p.set_defaults(func=run)


def _add_object_args(p: argparse.ArgumentParser) -> None:
    """Leases, eviction, clients, pending puts, placement and the request loop."""
    p.add_argument("--lease-ttl-ms", "--default_kv_lease_ttl", dest="lease_ttl_ms",
                   type=_duration_ms, default=_DEF.lease_ttl_s * 1000, help="read lease, ms")
    p.add_argument("--soft-pin-ttl-ms", "--default_kv_soft_pin_ttl", dest="soft_pin_ttl_ms",
                   type=_duration_ms, default=_DEF.soft_pin_ttl_s * 1000, help="soft pin, ms")
    p.add_argument("--high-watermark", "--eviction_high_watermark_ratio", dest="watermark",
                   type=float, default=_DEF.high_watermark)
    p.add_argument("--eviction-ratio", "--eviction_ratio", dest="eviction_ratio", type=float,
                   default=_DEF.eviction_ratio)
    p.add_argument("--client-ttl", "--client_ttl", dest="client_ttl", type=float,
                   default=_DEF.client_ttl_s, help="seconds without heartbeat before a "
                   "client is declared dead")
    p.add_argument("--put-discard-timeout", "--put_start_discard_timeout_sec",
                   dest="put_timeout", type=float, default=_DEF.put_discard_timeout_s)
    p.add_argument("--put-release-timeout", "--put_start_release_timeout_sec",
                   dest="put_release", type=float, default=_DEF.put_release_timeout_s,
                   help="seconds before memory of a discarded put is reused")
    p.add_argument("--allocation-strategy", "--allocation_strategy", dest="strategy",
                   choices=("random", "free_ratio_first"), default=_DEF.allocation_strategy)
    p.add_argument("--eviction-policy", default=_DEF.eviction_policy, help="lru or fifo")
    p.add_argument("--request-poll-us", type=int, default=_SRV.request_poll_us,
                   help="poll for the next request this long before blocking while requests "
                   f"come that fast; 0 always blocks (default {_SRV.request_poll_us})")


def _add_kv_events_args(p: argparse.ArgumentParser) -> None:
    """The pool's blocks published as vLLM KV events."""
    p.add_argument("--kv-events-endpoint", default=None, metavar="tcp://HOST:PORT",
                   help="publish the pool's blocks as vLLM KV events (medium cpu/disk) to this "
                   "ZMQ endpoint: host:port connects (the router binds), tcp://*:PORT binds; "
                   "default off")
    p.add_argument("--kv-events-replay-endpoint", default=None, metavar="tcp://HOST:PORT",
                   help="ZMQ ROUTER endpoint (bound) that replays recent KV-event batches")
    p.add_argument("--kv-events-topic", default="kvpool-pool",
                   help="topic of the pool's KV events (default kvpool-pool)")
    p.add_argument("--kv-events-block-size", type=int, default=0,
                   help="block size written in the pool's BlockStored events (default 0: unknown)")


def bind_host(args: argparse.Namespace) -> str:
    """The one address every server binds: the address flags must agree; without any, the
    loopback address, or all interfaces (Mooncake's default) when a token guards them."""
    given = {getattr(args, f"addr_{f.lstrip('-')}") for f in _ADDRESS_FLAGS} - {None}
    if len(given) > 1:
        raise ConfigError(f"kvpool master binds one address for RPC, admin and metadata; got "
                          f"{sorted(given)} from {', '.join(_ADDRESS_FLAGS)}")
    if given:
        return str(given.pop())
    return ALL_INTERFACES if args.token else _SRV.host


def _metadata_enabled(args: argparse.Namespace) -> bool:
    if args.metadata is not None:
        return bool(args.metadata)
    return args.kvpool_metadata_port is not None


def build_configs(args: argparse.Namespace) -> tuple[MasterServerConfig, MasterConfig]:
    port = args.kvpool_metadata_port if args.kvpool_metadata_port is not None \
        else args.metadata_port
    kv_events = None
    if args.kv_events_endpoint:
        kv_events = PoolEventsConfig(args.kv_events_endpoint, args.kv_events_replay_endpoint,
                                     args.kv_events_topic, args.kv_events_block_size)
    server = MasterServerConfig(bind_host(args), args.rpc_port, args.admin_port, port,
                                _metadata_enabled(args), token=args.token or None,
                                request_poll_us=args.request_poll_us, kv_events=kv_events)
    config = MasterConfig(lease_ttl_s=args.lease_ttl_ms / 1000,
                          soft_pin_ttl_s=args.soft_pin_ttl_ms / 1000,
                          high_watermark=args.watermark, eviction_ratio=args.eviction_ratio,
                          client_ttl_s=args.client_ttl,
                          put_discard_timeout_s=args.put_timeout,
                          put_release_timeout_s=args.put_release,
                          allocation_strategy=args.strategy,
                          eviction_policy=args.eviction_policy)
    return server, config


def exposure(server: MasterServerConfig, rpc_port: int, admin_port: int) -> str:
    """One line saying which servers listen where, and who can reach them."""
    ports = f"rpc {rpc_port}, admin http {admin_port}"
    if server.enable_http_metadata:
        ports += f", http metadata {server.metadata_port}"
    else:
        ports += ", no http metadata server"
    if is_loopback(server.host):
        return (f"listening on {server.host} only ({ports}): reachable from this host alone; "
                f"for other hosts pass --rpc_address=0.0.0.0 with --token (or --insecure)")
    guard = "token required" if server.token else "NO TOKEN: anyone who can reach it controls it"
    where = "all interfaces" if server.host in (ALL_INTERFACES, "::") else server.host
    return f"listening on {where} ({ports}); {guard}"


def run(args: argparse.Namespace) -> int:
    try:
        server_cfg, config = build_configs(args)
    except ConfigError as exc:
        print(f"kvpool master: {exc}", file=sys.stderr)
        return 2
    refusal = bind_refusal("master", server_cfg.host, args.token, args.insecure)
    if refusal is not None:
        print(refusal, file=sys.stderr)
        return 2
    if ha_flags.wants_persistence(args):
        return ha_flags.run_persistent(args, server_cfg, config)
    try:
        master = MasterServer(server_cfg, config).start()
        tune_gc_for_master()
    except (ConfigError, KvpoolError) as exc:
        log.error("%s", exc)
        return 2
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    announce_ready(f"kvpool master ready: rpc {master.address} admin {master.admin_port}; "
                   f"{exposure(server_cfg, master.rpc_port, master.admin_port)}")
    stop.wait()
    master.stop()
    return 0
