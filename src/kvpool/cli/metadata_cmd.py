"""`kvpool metadata`: run the standalone HTTP metadata server until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from kvpool.cli.security import add_security_args, bind_refusal
from kvpool.errors import ConfigError, KvpoolError
from kvpool.log import get_logger
from kvpool.units import format_size, parse_size

if TYPE_CHECKING:
    from kvpool.metadata.memory import MemoryBackend
    from kvpool.metadata.server import MetadataServer

_log = get_logger("cli.metadata")


def register(subparsers: argparse._SubParsersAction) -> None:
    from kvpool.metadata.base import (
        DEFAULT_MAX_KEY_LEN,
        DEFAULT_MAX_TOTAL_BYTES,
        DEFAULT_MAX_VALUE_BYTES,
    )

    parser = subparsers.add_parser(
        "metadata",
        help="run the HTTP metadata server (GET|PUT|DELETE /metadata?key=K)",
        description="Serve the segment directory over HTTP, compatible with Mooncake's "
        "metadata server. Transfer engines connect with http://HOST:PORT/metadata.",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8080, help="TCP port; 0 picks a free one")
    parser.add_argument(
        "--max-value-size", default=str(DEFAULT_MAX_VALUE_BYTES),
        help=f"largest value accepted, e.g. 16MB (default {format_size(DEFAULT_MAX_VALUE_BYTES)})",
    )
    parser.add_argument(
        "--max-total-size", default=str(DEFAULT_MAX_TOTAL_BYTES),
        help=f"all values together, e.g. 256MB (default {format_size(DEFAULT_MAX_TOTAL_BYTES)})",
    )
    parser.add_argument(
        "--max-key-len", type=int, default=DEFAULT_MAX_KEY_LEN,
        help=f"longest key in characters (default {DEFAULT_MAX_KEY_LEN})",
    )
    parser.add_argument(
        "--state-file", default=None, metavar="PATH",
        help="keep every key in this file (appended and fsynced before each reply, "
        "compacted by write-then-rename): a restarted server forgets nothing")
    parser.add_argument(
        "--etcd", default=None, metavar="HOST:PORT[,HOST:PORT]",
        help="write every change to etcd before replying and start from what it holds "
        "(under --etcd-prefix): a server restarted on any host forgets nothing")
    parser.add_argument("--etcd-prefix", default="/kvpool/metadata/",
                        help="etcd key prefix of this server's keys (default /kvpool/metadata/)")
    add_security_args(parser, "PUT and DELETE requests must carry (reads stay open)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvpool.metadata.server import MetadataLimits, MetadataServer

    refusal = bind_refusal("metadata", args.host, args.token, args.insecure)
    if refusal is not None:
        print(refusal, file=sys.stderr)
        return 2
    try:
        limits = MetadataLimits(parse_size(args.max_value_size), args.max_key_len,
                                parse_size(args.max_total_size))
        backend = _backend(args.state_file, args.etcd, args.etcd_prefix)
        server = MetadataServer(args.host, args.port, backend=backend, limits=limits,
                                token=args.token or None)
        try:
            server.serve_forever(on_ready=_announce)
        finally:
            backend.close()
    except KvpoolError as exc:
        _log.error("%s", exc)
        return 1
    return 0


def _backend(state_file: str | None, etcd: str | None, prefix: str) -> MemoryBackend:
    from kvpool.metadata.durable import DurableBackend
    from kvpool.metadata.memory import MemoryBackend

    if state_file and etcd:
        raise ConfigError("give --state-file or --etcd, not both")
    if etcd:
        from kvpool.metadata.etcd_mirror import EtcdMirroredBackend
        from kvpool.metadata.uri import parse_etcd_endpoints

        return EtcdMirroredBackend(parse_etcd_endpoints(etcd), prefix)
    return DurableBackend(state_file) if state_file else MemoryBackend()


def _announce(server: MetadataServer) -> None:
    # Printed (not logged) so that scripts can read the chosen port when --port 0.
    print(f"kvpool metadata server ready on {server.url}", flush=True)
