"""Entry point of the `kvpool` console script.

Every module named in `_COMMAND_MODULES` exposes `register(subparsers)`, which adds one or more
subcommands and sets `func(args) -> int` as their handler. Modules are imported only when the
CLI starts, so importing kvpool as a library never pulls in CLI code.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from kvpool import __version__
from kvpool.log import setup_logging

_COMMAND_MODULES = (
    "kvpool.cli.metadata_cmd",
    "kvpool.cli.bench_cmd",
    "kvpool.cli.master_cmd",
    "kvpool.cli.store_node_cmd",
    "kvpool.cli.sim_cmd",
    "kvpool.cli.mooncake_cmd",
    "kvpool.cli.up_cmd",
    "kvpool.cli.model_cmd",
    "kvpool.cli.worker_cmd",
    "kvpool.cli.generate_cmd",
    "kvpool.cli.proxy_cmd",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvpool", description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--version", action="version", version=f"kvpool {__version__}")
    parser.add_argument("--log-level", default=None, help="DEBUG, INFO (default), WARNING, ERROR")
    parser.add_argument("--ready-fd", type=int, default=None, help=argparse.SUPPRESS)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    """The command line as given (`kvpool proxy --workers N` starts copies of it)."""
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    setup_logging(args.log_level)
    if args.ready_fd is not None:  # a launcher's pipe (kvpool.launch.ready)
        from kvpool.launch.ready import set_ready_fd

        set_ready_fd(args.ready_fd)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
