"""How `kvpool up` keeps its cluster running: every child that exits (master, store node,
worker, proxy) is started again with backoff (kvpool.restart_policy, kvpool.supervisor), each
restart one line on stderr, until Ctrl-C / SIGTERM (exit status 0) or a child exits once more
than its budget allows (the cluster is stopped; exit status 1). The counts per child are kept
in a JSON file ({name: restarts}, replaced whole) that the proxy exports on /metrics
(`kvpool proxy --restart-counts`)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

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


def counts_file(token_path: Path) -> Path:
    """Where `kvpool up` keeps its restart counts: beside its token file."""
    return token_path.with_name(token_path.name.replace(".token", ".restarts.json"))


def write_counts(path: Path, counts: dict[str, int]) -> None:
    """Replace `path` with `counts` at once (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(counts, sort_keys=True))
    tmp.replace(path)


def supervise(children: Children, config: RestartConfig, counts: Path | None = None) -> int:
    """Until Ctrl-C / SIGTERM (0) or a child is given up on (1); the caller stops the
    children (and removes `counts`, kept up to date here when given). Either way the last
    line counts the restarts."""
    def publish(c: dict[str, int]) -> None:
        if counts is None:
            return
        try:
            write_counts(counts, c)
        except OSError as exc:  # the counts are a report: the cluster goes on without them
            say(f"cannot write the restart counts to {counts}: {exc}")

    supervisor = Supervisor(children, config, say=say, counted=publish)
    publish(supervisor.counts)
    print("Ctrl-C to stop.", flush=True)
    try:
        failure = supervisor.run()
    except KeyboardInterrupt:
        say(f"stopping the cluster; {supervisor.summary()}")
        return 0
    say(f"{failure}; stopping the cluster; {supervisor.summary()}")
    return 1
