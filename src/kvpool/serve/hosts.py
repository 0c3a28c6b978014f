"""A serving cluster over several emulated hosts on one Linux machine (needs root): which
process runs on which host. The hosts themselves (network namespaces on a bridge, each with its
own /dev/shm; `cut`/`heal` a host's link; `in_netns`) are kvpool.launch.netns's.

    netns <tag>-0:   eth0 10.231.60.1   master (+ metadata), store node
    netns <tag>-1:   eth0 10.231.60.2   store node, prefill worker
    netns <tag>-2:   eth0 10.231.60.3   store node, decode worker, proxy
    (more hosts: a store node and a worker each, prefill and decode in turn)

With `HostsSpec.ha` the masters are an HA pair elected through etcd, which runs alone on one
host more (its data in a temp dir removed on exit):

    netns <tag>-0:   10.231.60.1   master (HA, leads first), store node
    netns <tag>-1:   10.231.60.2   master (HA, stands by), store node, prefill worker
    netns <tag>-2:   10.231.60.3   store node, decode worker, proxy
    netns <tag>-N:   10.231.60.N+1 etcd  (N = num_hosts)

Store nodes and workers are given `--master etcd://E:2379` and store nodes `--metadata
etcd://E:2379` (no master serves HTTP metadata; workers handshake with peers), so they follow
a failover. The masters journal to etcd (their hosts share no disk) on a short lease
(HA_LEASE_TTL_S); a master that exits deposed is started again as a standby, as a service
manager would. `HostsCluster.master_roles()` asks each master, from its own host, whether it
leads.
"""

from __future__ import annotations

import os
import re
import secrets
import socket
import subprocess
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from kvpool.engine.gguf_checkpoint import served_name
from kvpool.errors import KvpoolError
from kvpool.launch.children import kvpool_argv, stop
from kvpool.launch.etcd import CLIENT_PORT as ETCD_PORT
from kvpool.launch.etcd import etcd_argv
from kvpool.launch.netns import Fabric, Host, fabric, in_netns
from kvpool.launch.ready import ReadyPipe
from kvpool.launch.wait import wait_for, wait_http
from kvpool.store.master.ha import DEPOSED_EXIT

RPC_PORT, ADMIN_PORT, METADATA_PORT, WORKER_PORT, PROXY_PORT = 50051, 9003, 8080, 8100, 8000
HA_LEASE_TTL_S = 2
"""The HA masters' leader lease (the least ha.py allows): a leader cut off from etcd stops
serving within it, and a standby takes over a moment after it expires in etcd."""
_Start = Callable[..., None]
"""start(name, host, *kvpool args, announce=False): one process on one host (`announce`: it
says on a pipe when it is ready, `HostsCluster.wait_ready`)."""


@dataclass(frozen=True)
class HostsSpec:
    model_dir: Path
    num_hosts: int = 3
    dram: str = "64MiB"
    """Each store node's memory."""
    master_args: tuple[str, ...] = ()
    worker_args: tuple[str, ...] = ()
    proxy_args: tuple[str, ...] = ()
    token: str = ""
    """Cluster token; empty: a random one."""
    ha: bool = False
    """Two masters (hosts 0 and 1) elected through etcd on one more host (num_hosts)."""


@dataclass(frozen=True)
class MasterRole:
    role: str
    """'leader', 'standby', or 'down' (no answer)."""
    term: int = 0
    """The term it leads; 0 unless leader (and for a lone master)."""


@dataclass
class HostsCluster:
    fabric: Fabric
    token: str
    model_name: str
    master_address: str = ""
    """What clients are given: HOST:PORT, or etcd://HOST:PORT with HA."""
    metadata_url: str = ""
    admin_url: str = ""
    """The (first) leader's admin server; with HA ask `leader()` for the current one."""
    proxy_host: int = 0
    proxy_url: str = ""
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    worker_urls: dict[str, list[str]] = field(default_factory=dict)
    master_hosts: list[int] = field(default_factory=list)
    """The hosts running a master: [0], or [0, 1] with HA."""
    etcd_endpoint: str = ""
    """HOST:PORT of etcd (HA only)."""
    master_restarts: dict[int, int] = field(default_factory=dict)
    """Host -> how often its deposed master was started again as a standby."""
    ready: dict[str, ReadyPipe] = field(default_factory=dict)
    """The readiness pipe of each process that announces it (kvpool.launch.ready)."""

    def wait_ready(self, name: str, what: str, timeout_s: float) -> None:
        """Until process `name` says it is ready; KvpoolError as soon as any exits."""
        self.ready[name].wait(self.procs[name], what, timeout_s, list(self.procs.values()))

    @property
    def hosts(self) -> list[Host]:
        """The serving hosts (the etcd host left out)."""
        return self.fabric.hosts[:len(self.fabric.hosts) - bool(self.etcd_endpoint)]

    def proxy_connection(self) -> socket.socket:
        """A TCP connection to the proxy, opened from inside its host's network namespace
        (blocking, no timeout: it may carry a long stream)."""
        host = self.fabric.hosts[self.proxy_host]
        with in_netns(host.netns):
            sock = socket.create_connection((host.addr, PROXY_PORT), timeout=10)
        sock.settimeout(None)
        return sock

    def master_admin_url(self, index: int) -> str:
        return f"http://{self.fabric.hosts[index].addr}:{ADMIN_PORT}"

    def master_roles(self) -> dict[int, MasterRole]:
        """Each master's own word (its admin /metrics, asked from its host)."""
        return {i: _ask_role(self.fabric.hosts[i], self.master_admin_url(i))
                for i in self.master_hosts}

    def leader(self) -> int | None:
        """The host whose master says it leads; None while none does (or two do: a bug the
        caller should see through master_roles)."""
        leaders = [i for i, r in self.master_roles().items() if r.role == "leader"]
        return leaders[0] if len(leaders) == 1 else None


def _ask_role(host: Host, admin_url: str) -> MasterRole:
    try:
        with in_netns(host.netns):
            text = httpx.get(admin_url + "/metrics", timeout=1.0).text
    except httpx.HTTPError:
        return MasterRole("down")
    roles = dict(re.findall(r'^kvpool_master_role\{role="(\w+)"\} ([\d.]+)$', text, re.M))
    term = re.search(r"^kvpool_master_term ([\d.]+)$", text, re.M)
    if not roles:
        return MasterRole("leader")  # a lone master
    role = "leader" if float(roles.get("leader", 0)) == 1 else "standby"
    return MasterRole(role, int(float(term.group(1))) if term and role == "leader" else 0)


@contextmanager
def hosts_cluster(spec: HostsSpec) -> Iterator[HostsCluster]:
    """The serving cluster of the module docstring over `spec.num_hosts` (>= 3) hosts, and
    with `spec.ha` one host more for etcd."""
    if spec.num_hosts < 3:
        raise KvpoolError(f"a cluster over hosts needs at least 3 of them, not {spec.num_hosts}")
    token = spec.token or secrets.token_hex(16)
    tag = f"kvha{os.getpid()}" if spec.ha else ""
    with fabric(spec.num_hosts + spec.ha, tag) as net, ExitStack() as stack:
        cluster = HostsCluster(net, token, served_name(spec.model_dir))
        env = {**os.environ, "KVPOOL_TOKEN": token}

        def launch(name: str, host: Host, argv: list[str], quiet: bool = False) -> None:
            cluster.procs[name] = host.spawn(argv, env, quiet)
            stack.callback(stop, cluster.procs[name])

        def start(name: str, host: Host, *args: str, announce: bool = False) -> None:
            if not announce:
                return launch(name, host, kvpool_argv(*args))
            pipe = cluster.ready[name] = ReadyPipe()
            stack.callback(pipe.close)
            try:
                cluster.procs[name] = host.spawn(pipe.argv(kvpool_argv(*args)), env,
                                                 pass_fds=[pipe.write_fd])
            finally:
                pipe.spawned()
            stack.callback(stop, cluster.procs[name])

        if spec.ha:
            _start_etcd(cluster, stack.enter_context(tempfile.TemporaryDirectory(
                prefix="kvpool-hosts-etcd-")), launch)
            _start_ha_masters(cluster, spec, start)
        else:
            _start_master(cluster, spec, start)
        _start_store_nodes(cluster, spec, start)
        _start_serving(cluster, spec, start)
        if spec.ha:
            stack.enter_context(_restarting_deposed(cluster, spec, start))
        yield cluster


def _start_master(cluster: HostsCluster, spec: HostsSpec, start: _Start) -> None:
    a = cluster.fabric.hosts[0].addr
    start("master", cluster.fabric.hosts[0], "master", "--host", a, "--rpc-port", str(RPC_PORT),
          "--admin-port", str(ADMIN_PORT), "--metadata-port", str(METADATA_PORT), *spec.master_args,
          announce=True)
    cluster.master_hosts = [0]
    cluster.master_address = f"{a}:{RPC_PORT}"
    cluster.metadata_url = f"http://{a}:{METADATA_PORT}/metadata"
    cluster.admin_url = f"http://{a}:{ADMIN_PORT}"
    cluster.wait_ready("master", "master", 60.0)


def _start_etcd(cluster: HostsCluster, data_dir: str,
                launch: Callable[[str, Host, list[str], bool], None]) -> None:
    """etcd alone on the last host, its data in `data_dir`."""
    host = cluster.fabric.hosts[-1]
    launch("etcd", host, etcd_argv("hosts", data_dir, host.addr), True)
    cluster.etcd_endpoint = f"{host.addr}:{ETCD_PORT}"
    cluster.master_address = cluster.metadata_url = f"etcd://{cluster.etcd_endpoint}"
    with in_netns(host.netns):
        wait_http(f"http://{cluster.etcd_endpoint}/health", [cluster.procs["etcd"]], "etcd")


def _ha_master_args(cluster: HostsCluster, spec: HostsSpec, host: Host) -> list[str]:
    """An HA master journaling to etcd (its hosts share no disk)."""
    return ["master", "--host", host.addr, "--rpc-port", str(RPC_PORT),
            "--admin-port", str(ADMIN_PORT), "--enable_ha=true",
            "--etcd_endpoints", cluster.etcd_endpoint, "--ha-lease-ttl", str(HA_LEASE_TTL_S),
            *spec.master_args]


def _start_ha_masters(cluster: HostsCluster, spec: HostsSpec, start: _Start) -> None:
    """Host 0's master first, so that it leads; then host 1's, which stands by."""
    cluster.master_hosts = [0, 1]
    for index, role in ((0, "leader"), (1, "standby")):
        host = cluster.fabric.hosts[index]
        start(f"master-{index}", host, *_ha_master_args(cluster, spec, host))
        _wait_role(cluster, index, role, list(cluster.procs.values()))
    cluster.admin_url = cluster.master_admin_url(0)


def _wait_role(cluster: HostsCluster, index: int, role: str,
               procs: list[subprocess.Popen[bytes]], timeout_s: float = 30.0) -> None:
    wait_for(lambda: cluster.master_roles()[index].role == role, timeout_s,
             f"host {index}'s master to be the {role}", 0.1, procs)


@contextmanager
def _restarting_deposed(cluster: HostsCluster, spec: HostsSpec, start: _Start,
                        poll_s: float = 0.2) -> Iterator[None]:
    """A master that exits deposed (it lost its lease) is started again, a fresh standby,
    as a service manager would (store/master/ha.py)."""
    done = threading.Event()

    def watch() -> None:
        while not done.wait(poll_s):
            for index in cluster.master_hosts:
                if cluster.procs[f"master-{index}"].poll() == DEPOSED_EXIT:
                    host = cluster.fabric.hosts[index]
                    start(f"master-{index}", host, *_ha_master_args(cluster, spec, host))
                    cluster.master_restarts[index] = cluster.master_restarts.get(index, 0) + 1

    watcher = threading.Thread(target=watch, daemon=True, name="kvpool-hosts-masters")
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()


def _start_store_nodes(cluster: HostsCluster, spec: HostsSpec, start: _Start) -> None:
    hosts = cluster.hosts
    for host in hosts:
        start(f"store-node-{host.index}", host, "store-node", "--dram", spec.dram,
              "--master", cluster.master_address, "--host", host.addr,
              "--metadata", cluster.metadata_url, announce=True)
    for host in hosts:  # a node announces once its memory is mounted
        cluster.wait_ready(f"store-node-{host.index}", "the store", 120.0)


def _start_serving(cluster: HostsCluster, spec: HostsSpec, start: _Start) -> None:
    hosts = cluster.hosts
    flags: list[str] = []
    for host in hosts[1:]:
        role = "prefill" if host.index % 2 else "decode"
        url = f"http://{host.addr}:{WORKER_PORT}"
        start(f"{role}-{host.index}", host, "worker", "--role", role,
              "--model", str(spec.model_dir), "--host", host.addr, "--port", str(WORKER_PORT),
              "--master", cluster.master_address, *spec.worker_args, announce=True)
        cluster.worker_urls.setdefault(role, []).append(url)
        flags += [f"--{role}", url]
    last = hosts[-1]
    for host in hosts[1:]:
        role = "prefill" if host.index % 2 else "decode"
        cluster.wait_ready(f"{role}-{host.index}", "a worker", 120.0)
    start("proxy", last, "proxy", "--model", str(spec.model_dir), "--host", last.addr,
          "--port", str(PROXY_PORT), *flags, *spec.proxy_args)
    cluster.proxy_host, cluster.proxy_url = last.index, f"http://{last.addr}:{PROXY_PORT}"
    with in_netns(last.netns):
        wait_http(cluster.proxy_url + "/health", list(cluster.procs.values()),
                  "the serving cluster", timeout_s=120)
