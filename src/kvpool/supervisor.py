"""Watches a launcher's named child processes and starts again each one that exits, as its
`RestartPolicy` (kvpool.restart_policy) says, until one exhausts its budget.

Mechanism only: the schedule and the budget are the policy's. The children are whatever
implements `Children` (a name -> process table and `restart(name)`, which starts that child
again with the command it was first started with). Everything runs on the caller's thread
(children carry a parent-death signal, which Linux ties to the thread that forked them).
Each decision is one line through `say`, and every restart calls `counted` with the counts
per child (to publish them); `summary()` says what was restarted.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from kvpool.clock import SYSTEM_CLOCK, Clock
from kvpool.restart_policy import GiveUp, RestartConfig, RestartPolicy


class Children(Protocol):
    @property
    def procs(self) -> dict[str, subprocess.Popen[Any]]:
        """Every child by name, the latest incarnation of each."""
        ...

    def restart(self, name: str) -> subprocess.Popen[Any]:
        """Start child `name` again (its last incarnation has exited); returns the new one,
        which `procs` names from then on."""
        ...


@dataclass(frozen=True)
class Failure:
    """Why supervision stopped: child `name` exited (`status`) once more than its budget."""

    name: str
    status: str
    give_up: GiveUp

    def __str__(self) -> str:
        n = self.give_up.num_restarts
        return (f"giving up on {self.name}: it {self.status} after {n} restart"
                f"{'' if n == 1 else 's'} within {self.give_up.window_s:g} s")


def describe_exit(returncode: int) -> str:
    """`exited with status 3`, `was killed by SIGKILL`."""
    if returncode >= 0:
        return f"exited with status {returncode}"
    try:
        return f"was killed by {signal.Signals(-returncode).name}"
    except ValueError:
        return f"was killed by signal {-returncode}"


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class Supervisor:
    """The only one that starts children again. A restart is counted when it is decided (the
    child then waits out its delay, unless the launcher stops first)."""

    def __init__(self, children: Children, config: RestartConfig, clock: Clock = SYSTEM_CLOCK,
                 say: Callable[[str], None] = _stderr,
                 counted: Callable[[dict[str, int]], None] = lambda counts: None) -> None:
        self.children = children
        self.config = config
        self.clock = clock
        self.say = say
        self.counted = counted
        self.policies: dict[str, RestartPolicy] = {}
        self._due: dict[str, float] = {}
        """Children waiting out their backoff: name -> when to start them again."""

    def check(self) -> Failure | None:
        """One look at every child: start again those whose wait is over, decide for those
        that exited since the last look. A Failure when one is given up on (the others are
        left as they are: stopping them is the launcher's)."""
        now = self.clock.now()
        for name, proc in list(self.children.procs.items()):
            if name in self._due:
                if now >= self._due[name]:
                    del self._due[name]
                    new = self.children.restart(name)
                    self.say(f"{name} started again (pid {new.pid})")
            elif proc.poll() is not None:
                failure = self._decide(name, proc, now)
                if failure is not None:
                    return failure
        return None

    def run(self, interval_s: float = 0.25) -> Failure:
        """`check` every `interval_s` until a child is given up on (forever otherwise; a
        KeyboardInterrupt goes through)."""
        while True:
            failure = self.check()
            if failure is not None:
                return failure
            self.clock.sleep(interval_s)

    @property
    def num_restarts(self) -> dict[str, int]:
        """Restarts decided per child that has had any."""
        return {n: p.num_restarts for n, p in self.policies.items() if p.num_restarts}

    @property
    def counts(self) -> dict[str, int]:
        """Restarts decided per child, every child named (0 for most)."""
        return {name: self.num_restarts.get(name, 0) for name in self.children.procs}

    def summary(self) -> str:
        counts = self.num_restarts
        if not counts:
            return "no process was restarted"
        each = ", ".join(f"{n} {c}" for n, c in sorted(counts.items()))
        total = sum(counts.values())
        return f"{total} restart{'s' if total > 1 else ''} ({each})"

    def _decide(self, name: str, proc: subprocess.Popen[Any], now: float) -> Failure | None:
        policy = self.policies.setdefault(name, RestartPolicy(self.config, self.clock))
        status = describe_exit(proc.returncode)
        decision = policy.on_exit()
        if isinstance(decision, GiveUp):
            return Failure(name, status, decision)
        self._due[name] = now + decision.delay_s
        self.say(f"{name} (pid {proc.pid}) {status}; restart {decision.attempt} of at most "
                 f"{self.config.max_restarts} within {self.config.window_s:g} s, in "
                 f"{decision.delay_s:g} s (restarts so far: {policy.num_restarts})")
        self.counted(self.counts)
        return None
