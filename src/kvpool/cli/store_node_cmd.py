"""`kvpool store-node --dram 8GiB --master HOST:PORT`: contribute DRAM to the KVCache pool.

`kvpool store-node drain ADDR --master HOST:PORT`: move a node's objects away (store_drain.py)."""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from kvpool.cli.security import add_security_args, bind_refusal, export_token
from kvpool.cli.store_drain import add_drain_args, run_drain
from kvpool.errors import ConfigError, KvpoolError
from kvpool.log import get_logger
from kvpool.store.client.config import ClientConfig
from kvpool.store.node.daemon import run_store_node
from kvpool.store.node.ssd_worker import DEFAULT_PROMOTE_AFTER, SsdConfig
from kvpool.units import parse_size

log = get_logger("cli.store_node")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("store-node", help="contribute DRAM to the KVCache pool")
    p.add_argument("--dram", help="memory to contribute, e.g. 8GiB (required but for drain)")
    p.add_argument("--master", default="127.0.0.1:50051", help="master RPC HOST:PORT")
    p.add_argument("--host", default="127.0.0.1", help="transfer-engine listen address")
    p.add_argument("--port", type=int, default=0, help="transfer-engine port (0 = free)")
    p.add_argument("--metadata", default="P2PHANDSHAKE",
                   help="P2PHANDSHAKE, http://HOST:PORT/metadata or etcd://HOST:PORT")
    p.add_argument("--protocol", default="auto", choices=("auto", "tcp", "shm"))
    p.add_argument("--heartbeat-interval", type=float, default=1.0, help="seconds")
    p.add_argument("--request-poll-us", type=int, default=ClientConfig.request_poll_us,
                   help="a busy transfer connection polls for its next request this long "
                   "before blocking; 0 always blocks (default %(default)s)")
    p.add_argument("--ssd", default=None, metavar="DIR",
                   help="keep objects evicted from DRAM in files under DIR (disk tier)")
    p.add_argument("--ssd-size", default=None, help="disk space for the disk tier, e.g. 100GiB")
    p.add_argument("--ssd-promote-after", type=int, default=DEFAULT_PROMOTE_AFTER,
                   metavar="K", help="reads of an object on disk after which it stays in "
                   f"DRAM again (default {DEFAULT_PROMOTE_AFTER})")
    p.add_argument("--ssd-fsync", action="store_true",
                   help="fsync every file (and the directory) so that it survives a power loss")
    add_security_args(p, "the master, the metadata server and peers' transfer engines "
                         "expect")
    add_drain_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.action == "drain":
        return run_drain(args)
    if args.dram is None:
        print("kvpool store-node: the following arguments are required: --dram",
              file=sys.stderr)
        return 2
    refusal = bind_refusal("store-node", args.host, args.token, args.insecure)
    if refusal is not None:
        print(refusal, file=sys.stderr)
        return 2
    export_token(args.token)  # also for the metadata client inside the transfer engine
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        config = ClientConfig(master=args.master, local_hostname=args.host, te_port=args.port,
                              metadata=args.metadata, protocol=args.protocol,
                              global_segment_size=parse_size(args.dram), local_buffer_size=0,
                              heartbeat_interval_s=args.heartbeat_interval,
                              request_poll_us=args.request_poll_us, token=args.token or None)
        run_store_node(config, stop, ssd=_ssd_config(args))
    except KvpoolError as exc:
        log.error("%s", exc)
        return 2
    return 0


def _ssd_config(args: argparse.Namespace) -> SsdConfig | None:
    if args.ssd is None:
        if args.ssd_size is not None:
            raise ConfigError("--ssd-size needs --ssd DIR")
        return None
    if args.ssd_size is None:
        raise ConfigError("--ssd DIR needs --ssd-size, e.g. --ssd-size 100GiB")
    return SsdConfig(args.ssd, parse_size(args.ssd_size), args.ssd_promote_after,
                     args.ssd_fsync)
