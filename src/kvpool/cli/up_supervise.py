"""How `kvpool up` keeps its cluster running: every child that exits (master, store node,
worker, proxy) is started again with backoff (kvpool.restart_policy, kvpool.supervisor), each
restart one line on stderr, until Ctrl-C / SIGTERM (exit status 0) or a child exits once more
than its budget allows (the cluster is stopped; exit status 1)."""

from __future__ import annotations

import argparse
import sys

from kvpool.restart_policy import RestartConfig
from kvpool.supervisor import Children, Supervisor

_D = RestartConfig()


def add_restart_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-restarts", type=int, default=_D.max_restarts, metavar="N",
                   help="restarts of one process allowed within --restart-window-s; its next "
                   f"exit stops the cluster with exit status 1 (default {_D.max_restarts}; "
                   "0: any exit stops it)")
    p.add_argument("--restart-window-s", type=float, default=_D.window_s, metavar="S",
                   help=f"the window of --max-restarts and of the backoff (default "
                   f"{_D.window_s:g}; waits of {_D.first_delay_s:g} s doubling up to "
                   f"{_D.max_delay_s:g} s)")


def restart_config(args: argparse.Namespace) -> RestartConfig:
    """ConfigError (one line) for a bad --max-restarts / --restart-window-s."""
    return RestartConfig(max_restarts=args.max_restarts, window_s=args.restart_window_s)


def say(line: str) -> None:
    print(f"kvpool up: {line}", file=sys.stderr, flush=True)


def supervise(children: Children, config: RestartConfig) -> int:
    """Until Ctrl-C / SIGTERM (0) or a child is given up on (1); the caller stops the
    children. Either way the last line counts the restarts."""
    supervisor = Supervisor(children, config, say=say)
    print("Ctrl-C to stop.", flush=True)
    try:
        failure = supervisor.run()
    except KeyboardInterrupt:
        say(f"stopping the cluster; {supervisor.summary()}")
        return 0
    say(f"{failure}; stopping the cluster; {supervisor.summary()}")
    return 1
