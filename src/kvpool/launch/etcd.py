"""etcd for kvpool's HA masters and segment directory: its one command line (`etcd_argv`: a
one-member cluster on one address), and `EtcdProcess`, an etcd on loopback that keeps its
ports and data across `kill`/`start` (the fault tests and benchmarks), and dies with the
process that started it."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
from contextlib import ExitStack

from kvpool.errors import KvpoolError
from kvpool.launch.children import die_with_parent, stop
from kvpool.launch.ports import free_port
from kvpool.launch.wait import wait_port

CLIENT_PORT, PEER_PORT = 2379, 2380
"""etcd's own ports, where a host has one to itself."""


def etcd_binary() -> str:
    """The `etcd` program; KvpoolError naming the package when there is none."""
    binary = shutil.which("etcd")
    if binary is None:
        raise KvpoolError("no `etcd` command: install the Debian package etcd-server "
                          "(./scripts/setup.sh does)")
    return binary


def etcd_argv(name: str, data_dir: str, host: str = "127.0.0.1", client_port: int = CLIENT_PORT,
              peer_port: int = PEER_PORT, binary: str | None = None) -> list[str]:
    """A one-member etcd cluster called `name`, its data in `data_dir`, serving clients on
    host:client_port and its (only) peer on host:peer_port."""
    client, peer = f"http://{host}:{client_port}", f"http://{host}:{peer_port}"
    return [binary or etcd_binary(), "--name", name, "--data-dir", data_dir,
            "--listen-client-urls", client, "--advertise-client-urls", client,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"{name}={peer}"]


class EtcdProcess:
    """A one-member etcd on loopback that keeps its ports and data across `kill`/`start`;
    stopped (SIGTERM) and its data removed when `stack` closes."""

    def __init__(self, stack: ExitStack, name: str = "kvp") -> None:
        self.binary, self.name = etcd_binary(), name
        self.data_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvp-etcd-"))
        self.client_port, self.peer_port = free_port(), free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        stack.callback(self.kill, signal.SIGTERM)

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def start(self, timeout_s: float = 30.0) -> EtcdProcess:
        """Start it (again) and wait until it accepts clients."""
        argv = etcd_argv(self.name, self.data_dir, "127.0.0.1", self.client_port,
                         self.peer_port, self.binary)
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     preexec_fn=die_with_parent(os.getpid()))
        wait_port(self.client_port, timeout_s=timeout_s, procs=[self.proc])
        return self

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None:
            stop(self.proc, 10.0, sig)
            self.proc = None
