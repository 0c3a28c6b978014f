"""`kvpool mooncake activate|deactivate|status`: the Mooncake drop-in switch.

`activate` makes `import mooncake.store` and `import mooncake.engine` resolve to kvpool in an
environment where the real Mooncake is not installed; `deactivate` undoes it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvpool.compat import activate as shim


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("mooncake", help="use kvpool as a drop-in for Mooncake's Python API")
    sub = p.add_subparsers(dest="mooncake_command", metavar="ACTION", required=True)
    for name, func, text in (
        ("activate", _activate, "make `import mooncake.*` resolve to kvpool"),
        ("deactivate", _deactivate, "remove kvpool's mooncake package"),
        ("status", _status, "show whether kvpool or the real Mooncake answers `import mooncake`"),
    ):
        q = sub.add_parser(name, help=text)
        q.add_argument("--target", type=Path, default=None,
                       help="site-packages directory to act on (default: this environment's)")
        q.add_argument("--scripts", type=Path, default=None,
                       help="bin directory for the `mooncake_master` command (default: this "
                       "environment's when --target is not given, none otherwise)")
        q.set_defaults(func=func)


def _target(args: argparse.Namespace) -> Path:
    return Path(args.target) if args.target is not None else shim.default_target()


def _scripts(args: argparse.Namespace) -> Path | None:
    if args.scripts is not None:
        return Path(args.scripts)
    return shim.default_scripts() if args.target is None else None


def _activate(args: argparse.Namespace) -> int:
    done, message = shim.activate(_target(args), _scripts(args))
    print(message)
    return 0 if done else 1


def _deactivate(args: argparse.Namespace) -> int:
    done, message = shim.deactivate(_target(args), _scripts(args))
    print(message)
    return 0 if done else 1


def _status(args: argparse.Namespace) -> int:
    state = shim.status(_target(args))
    print(f"target: {state.target}")
    print(f"kvpool shim active: {'yes' if state.shim_active else 'no'}")
    print(f"real Mooncake installed: {', '.join(state.real_mooncake) or 'no'}")
    if state.foreign_package:
        print("a mooncake package that is not kvpool's is present")
    return 0
