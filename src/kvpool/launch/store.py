"""Store processes on loopback for the fault tests, the benchmarks and the tests' store
cluster: `kvpool master` and `kvpool store-node` children on fresh ports (`start_master`,
`start_nodes`), a kvpool child (or several started together) waited for until it says it is
ready (`start_ready`, `start_all_ready`: masters, store nodes, workers), and an HA pair
of masters on one etcd (`start_ha_pair`). Every child is stopped (SIGTERM, then SIGKILL) when
the caller's ExitStack closes, and dies with the caller however it ends; children run this
very kvpool (its source first on PYTHONPATH) and log errors only unless told otherwise."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from kvpool.launch.children import die_with_parent, stop
from kvpool.launch.etcd import EtcdProcess
from kvpool.launch.ports import free_port
from kvpool.launch.ready import ReadyPipe
from kvpool.launch.wait import wait_for
from kvpool.store.client.config import ClientConfig
from kvpool.store.wire.leader import Etcd, parse_endpoints, read_leader

HA_TTL_S = 2
"""The HA pair's leader lease (the least ha.py allows)."""


def spawn_kvpool(*args: str, quiet: bool = True, log_level: str = "ERROR",
                 ready: ReadyPipe | None = None, show_errors: bool = False,
                 environ: Mapping[str, str] | None = None) -> subprocess.Popen[bytes]:
    """`python -m kvpool args...` as its own process that dies with this one (stdout and
    stderr discarded when `quiet`, stderr kept with `show_errors`), logging at `log_level`
    unless $KVPOOL_LOG_LEVEL says otherwise; with `ready`, announcing on that pipe
    (`ready.wait`). `environ`: the environment it starts from (None: this process's)."""
    env = dict(os.environ if environ is None else environ)
    env.setdefault("KVPOOL_LOG_LEVEL", log_level)
    here = str(Path(__file__).resolve().parents[2])   # children run this very kvpool
    env["PYTHONPATH"] = here + os.pathsep + env.get("PYTHONPATH", "")
    argv: Sequence[str] = [sys.executable, "-m", "kvpool", *args]
    if ready is not None:
        argv = ready.argv(argv)
    try:
        return subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL if quiet else None,
                                stderr=subprocess.DEVNULL if quiet and not show_errors else None,
                                preexec_fn=die_with_parent(os.getpid()),
                                pass_fds=() if ready is None else (ready.write_fd,))
    finally:
        if ready is not None:
            ready.spawned()


def owned(stack: ExitStack, proc: subprocess.Popen[bytes],
          timeout_s: float = 5.0) -> subprocess.Popen[bytes]:
    """Stop `proc` (SIGTERM, then SIGKILL after `timeout_s`) when `stack` closes."""
    stack.callback(stop, proc, timeout_s)
    return proc


def start_ready(stack: ExitStack, *args: str, what: str, timeout_s: float = 30.0,
                quiet: bool = True, log_level: str = "ERROR",
                stop_timeout_s: float = 5.0) -> subprocess.Popen[bytes]:
    """`kvpool ARGS` (a command that announces, kvpool.launch.ready: a master, a store node,
    a worker) owned by `stack`, once it has said it is ready; KvpoolError naming `what` if
    it exits first, TimeoutError after `timeout_s`."""
    return start_all_ready(stack, [args], what, timeout_s, quiet=quiet, log_level=log_level,
                           stop_timeout_s=stop_timeout_s)[0]


def start_all_ready(stack: ExitStack, commands: Sequence[Sequence[str]], what: str,
                    timeout_s: float = 30.0, quiet: bool = True, log_level: str = "ERROR",
                    stop_timeout_s: float = 5.0, show_errors: bool = False,
                    environ: Mapping[str, str] | None = None) -> list[subprocess.Popen[bytes]]:
    """`start_ready` for several commands started together (workers loading their models
    side by side), returned once every one has said it is ready; a failure names `what`
    and the command's index. `environ` as `spawn_kvpool`'s."""
    pipes = [ReadyPipe() for _ in commands]
    try:
        procs = [owned(stack, spawn_kvpool(*args, quiet=quiet, log_level=log_level, ready=pipe,
                                           show_errors=show_errors, environ=environ),
                       stop_timeout_s)
                 for args, pipe in zip(commands, pipes, strict=True)]
        for i, (proc, pipe) in enumerate(zip(procs, pipes, strict=True)):
            name = what if len(commands) == 1 else f"{what} {i}"
            pipe.wait(proc, name, timeout_s, others=procs)
    finally:
        for pipe in pipes:
            pipe.close()
    return procs


@dataclass
class HaPair:
    """Two HA masters on one etcd (journaling there, or to one shared state directory)."""

    etcd: EtcdProcess
    masters: list[subprocess.Popen[bytes]]
    rpc_ports: list[int]
    admin_ports: list[int]
    cluster_id: str

    @property
    def address(self) -> str:
        return f"etcd://{self.etcd.endpoint}/{self.cluster_id}"

    def client_config(self) -> ClientConfig:
        """A client that follows the leader through etcd and gives up on a dead one fast."""
        return ClientConfig(master=self.address, rpc_timeout_s=1.0, transfer_timeout_s=3.0)

    def index_of(self, leader_address: str) -> int:
        return next(i for i, p in enumerate(self.rpc_ports) if leader_address.endswith(f":{p}"))


def start_ha_pair(stack: ExitStack, etcd: EtcdProcess, state_dir: Path | None, cluster_id: str,
                  ttl_s: int = 2) -> HaPair:
    """Two HA masters journaling to `state_dir`, or to etcd itself when None."""
    pair = HaPair(etcd, [], [], [], cluster_id)
    shared = ["--state-dir", str(state_dir)] if state_dir is not None else []
    for _ in range(2):
        rpc, admin = free_port(), free_port()
        pair.masters.append(owned(stack, spawn_kvpool(
            "master", "--enable_ha=true", f"--etcd_endpoints={etcd.endpoint}",
            "--cluster_id", cluster_id, *shared,
            "--rpc_port", str(rpc), "--metrics_port", str(admin), "--no-http-metadata",
            "--ha-lease-ttl", str(ttl_s), "--recovery-grace", "20")))
        pair.rpc_ports.append(rpc)
        pair.admin_ports.append(admin)
    return pair


def start_master(stack: ExitStack, *flags: str) -> tuple[subprocess.Popen[bytes], str, list[str]]:
    """A plain master on fresh ports, once it listens: (process, rpc address, its argv for
    a restart)."""
    rpc, admin = free_port(), free_port()
    argv = ["master", "--rpc_port", str(rpc), "--metrics_port", str(admin),
            "--no-http-metadata", *flags]
    proc = start_ready(stack, *argv, what="the master")
    return proc, f"127.0.0.1:{rpc}", argv


def start_nodes(stack: ExitStack, master: str, count: int, dram: str = "16MiB",
                *extra: str) -> list[subprocess.Popen[bytes]]:
    return [owned(stack, spawn_kvpool("store-node", "--dram", dram, "--master", master,
                                      "--heartbeat-interval", "0.2", *extra))
            for _ in range(count)]


def wait_leader(etcd: EtcdProcess, cluster_id: str, not_term: int = 0,
                timeout_s: float = 30.0) -> tuple[str, int]:
    """(address, term) of the leader of `cluster_id` in etcd, once there is one whose term
    is not `not_term` (a failover's new leader); TimeoutError after `timeout_s`."""
    client = Etcd(parse_endpoints(etcd.endpoint))

    def leader() -> tuple[str, int] | None:
        try:
            found = read_leader(client, cluster_id)
        except Exception:  # noqa: BLE001 - etcd restarting
            return None
        return found if found is not None and found[1] != not_term else None

    return wait_for(leader, timeout_s, f"a leader for {cluster_id}", 0.05)


def ha_cluster(stack: ExitStack, etcd: EtcdProcess, cluster_id: str,
               ttl_s: int = HA_TTL_S) -> tuple[HaPair, int, int]:
    """An HA pair keeping its journal in etcd (the default) and two store nodes started;
    (pair, leader's index, leader's term)."""
    pair = start_ha_pair(stack, etcd, None, cluster_id, ttl_s)
    leader_addr, term = wait_leader(etcd, cluster_id)
    start_nodes(stack, pair.address, 2)
    return pair, pair.index_of(leader_addr), term
