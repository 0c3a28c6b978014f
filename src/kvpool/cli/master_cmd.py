"""`kvpool master`: the store's metadata master (RPC, admin HTTP, embedded HTTP metadata).

Mooncake's `mooncake_master` flag spellings are accepted as aliases, with Mooncake's units
(`--default_kv_lease_ttl` in ms, `--client_ttl` in s).
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from kvpool.cli import ha_flags
from kvpool.cli.security import add_security_args, bind_refusal
from kvpool.errors import ConfigError, KvpoolError
from kvpool.log import get_logger
from kvpool.store.config import MasterConfig
from kvpool.store.master import MasterServer, MasterServerConfig, tune_gc_for_master

log = get_logger("cli.master")
_DEF = MasterConfig()
_SRV = MasterServerConfig()


def _bool(value: str) -> bool:
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")


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


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("master", help="run the KVCache store master")
    p.add_argument("--host", default=_SRV.host, help="address to bind (default 127.0.0.1)")
    p.add_argument("--rpc-port", "--rpc_port", "--port", dest="rpc_port", type=int,
                   default=_SRV.rpc_port, help="control-plane RPC port (default 50051)")
    p.add_argument("--admin-port", "--metrics_port", "--metrics-port", dest="admin_port",
                   type=int, default=_SRV.admin_port, help="admin HTTP port (default 9003)")
    p.add_argument("--metadata-port", "--http_metadata_server_port", dest="metadata_port",
                   type=int, default=_SRV.metadata_port,
                   help="embedded HTTP metadata port (default 8080)")
    p.add_argument("--enable_http_metadata_server", dest="metadata", type=_bool, nargs="?",
                   const=True, default=True, help="serve HTTP metadata (default on)")
    p.add_argument("--no-http-metadata", dest="metadata", action="store_false",
                   help="do not embed the HTTP metadata server")
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
    add_security_args(p, "RPC clients must prove, and that metadata writes and admin "
                         "listings must carry")
    ha_flags.add_ha_args(p)
    p.set_defaults(func=run)


def build_configs(args: argparse.Namespace) -> tuple[MasterServerConfig, MasterConfig]:
    server = MasterServerConfig(args.host, args.rpc_port, args.admin_port, args.metadata_port,
                                args.metadata, token=args.token or None)
    config = MasterConfig(lease_ttl_s=args.lease_ttl_ms / 1000,
                          soft_pin_ttl_s=args.soft_pin_ttl_ms / 1000,
                          high_watermark=args.watermark, eviction_ratio=args.eviction_ratio,
                          client_ttl_s=args.client_ttl,
                          put_discard_timeout_s=args.put_timeout,
                          put_release_timeout_s=args.put_release,
                          allocation_strategy=args.strategy,
                          eviction_policy=args.eviction_policy)
    return server, config


def run(args: argparse.Namespace) -> int:
    if ha_flags.wants_persistence(args):
        return ha_flags.run_persistent(args, build_configs)
    refusal = bind_refusal("master", args.host, args.token, args.insecure)
    if refusal is not None:
        print(refusal, file=sys.stderr)
        return 2
    try:
        server_cfg, config = build_configs(args)
        master = MasterServer(server_cfg, config).start()
        tune_gc_for_master()
    except (ConfigError, KvpoolError) as exc:
        log.error("%s", exc)
        return 2
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    print(f"kvpool master ready: rpc {master.address} admin {master.admin_port}", flush=True)
    stop.wait()
    master.stop()
    return 0
