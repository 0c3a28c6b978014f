"""A launcher's named children (`ChildTable`): each started once with its command, startable
again with the same command (kvpool.supervisor.Children), waited for until it announces that
it is ready (kvpool.launch.ready), and stopped in order, a group at a time."""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from kvpool.launch.children import (
    Command,
    kvpool_argv,
    signal_group,
    spawn_command,
    stop_together,
)
from kvpool.launch.ready import ReadyPipe
from kvpool.transfer.segment import pid_exists


class ChildTable:
    """Named `kvpool` children that die with this process, each startable again with the
    command it was first started with (kvpool.supervisor.Children). A dataclass using it
    declares the three tables as fields."""

    procs: dict[str, subprocess.Popen[bytes]]
    """Every child by name, the latest incarnation of each, in the order first started."""
    commands: dict[str, Command]
    """Each child's command (ports included, so it comes back where it was)."""
    ready: dict[str, ReadyPipe]
    """The readiness pipe of each child that announces it (`start(..., announce=True)`)."""

    def start(self, name: str, *args: str, announce: bool = False) -> subprocess.Popen[bytes]:
        """Child `name`: `kvpool ARGS`; stopped by `stop_all`. `announce`: it says on a pipe
        when it is ready (`wait_ready`); a master, store node or worker can."""
        return self.run(name, Command(tuple(kvpool_argv(*args))), announce)

    def run(self, name: str, command: Command, announce: bool = False
            ) -> subprocess.Popen[bytes]:
        """Child `name`: any program (a vLLM server); stopped by `stop_all`."""
        self.commands[name] = command
        old = self.ready.pop(name, None)
        if old is not None:
            old.close()
        if not announce:
            self.procs[name] = spawn_command(command)
            return self.procs[name]
        pipe = self.ready[name] = ReadyPipe()
        try:
            self.procs[name] = spawn_command(Command(pipe.argv(command.argv), command.env,
                                                     command.log), pass_fds=[pipe.write_fd])
        finally:
            pipe.spawned()
        return self.procs[name]

    def restart(self, name: str) -> subprocess.Popen[bytes]:
        """Start child `name` again (its last incarnation has exited; what it started in its
        session, a vLLM server's engine processes, is killed first). A worker comes back on
        its URL, where the proxy's poller finds it and has it prove the cluster token again
        before it rejoins the rotation."""
        old = self.procs.get(name)
        if old is not None and old.poll() is not None and not pid_exists(old.pid):
            signal_group(old.pid, signal.SIGKILL)  # (a group whose leader is gone is ours)
        return self.run(name, self.commands[name], name in self.ready)

    def wait_ready(self, name: str, what: str, timeout_s: float) -> str:
        """Until child `name` announces that it is ready (its line); KvpoolError as soon as it
        or another child exits, TimeoutError after `timeout_s`."""
        return self.ready[name].wait(self.procs[name], what, timeout_s,
                                     list(self.procs.values()))

    def exited(self) -> list[str]:
        return [name for name, p in self.procs.items() if p.poll() is not None]

    def stop_all(self, say: Callable[[str], None] | None = None) -> None:
        """Stop every child, last started first, a group at a time (the proxy, the workers,
        the store nodes, the master): SIGTERM to the whole group, then each is waited for
        (SIGKILL after 10 s), with what each started in its session (a vLLM server's engine
        processes): the 10 s are the group's, not each child's in turn. A SIGINT or SIGTERM
        meanwhile is ignored (it would cut the stop short and leave children running). `say`
        is told each group as it goes and the end."""
        started = time.monotonic()
        with _uninterrupted():
            for group, procs in _groups(list(self.procs.items())[::-1]):
                if say is not None and any(p.poll() is None for p in procs):
                    say(f"stopping {group}")
                stop_together(procs)
            for pipe in self.ready.values():
                pipe.close()
        if say is not None:
            say(f"stopped ({time.monotonic() - started:.1f} s)")


@contextmanager
def _uninterrupted() -> Iterator[None]:
    """SIGINT and SIGTERM ignored for the block (on the main thread, where handlers live)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)


def _groups(named: list[tuple[str, subprocess.Popen[bytes]]]
            ) -> list[tuple[str, list[subprocess.Popen[bytes]]]]:
    """`named` children in runs of one kind, in order: (what to call the run, its children)."""
    out: list[tuple[str, list[subprocess.Popen[bytes]]]] = []
    for name, proc in named:
        kind = _kind(name)
        if out and out[-1][0] == kind:
            out[-1][1].append(proc)
        else:
            out.append((kind, [proc]))
    return [(_plural(kind, len(procs)), procs) for kind, procs in out]


def _kind(name: str) -> str:
    """A child's kind from its name: prefill-0 and decode-1 are workers, store-node-2 a
    store node; others (proxy, master, etcd) are their own kind."""
    if name.split("-")[0] in ("prefill", "decode", "both"):
        return "worker"
    return "store node" if name.startswith("store-node") else name


def _plural(kind: str, count: int) -> str:
    return f"the {kind}" if count == 1 else f"{count} {kind}s"
