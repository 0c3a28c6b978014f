"""A serving cluster over several emulated hosts on one Linux machine (needs root).

Each host is a network namespace with one address on a bridge, and a mount namespace with a
/dev/shm of its own (a tmpfs), so shm works within a host and never across hosts, as on real
machines. The bridge lives in a namespace of its own: nothing is added to the caller's.

    netns <tag>-br:  br0 -- v0 -- v1 -- v2 ...  (veth ends, one per host)
                           |     |     |
    netns <tag>-0:   eth0 10.231.60.1   master (+ metadata), store node
    netns <tag>-1:   eth0 10.231.60.2   store node, prefill worker
    netns <tag>-2:   eth0 10.231.60.3   store node, decode worker, proxy
    (more hosts: a store node and a worker each, prefill and decode in turn)

The addresses exist only inside these namespaces. A host's processes are started through
`nsenter` into a holder process (`sleep`) that owns the host's mount namespace. `cut(i)` takes
host i's port on the bridge down (its link is dead, its processes keep running); `heal(i)`
brings it back. This process reaches a host's servers by switching one thread into the host's
network namespace (`in_netns`). Everything is stopped and deleted on exit, failures included.
"""

from __future__ import annotations

import ctypes
import os
import secrets
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from kvpool.engine.gguf_checkpoint import served_name
from kvpool.errors import KvpoolError
from kvpool.procs import kvpool_argv, stop
from kvpool.serve.launch import die_with_parent, wait_http, wait_segments

SUBNET = "10.231.60"
RPC_PORT, ADMIN_PORT, METADATA_PORT, WORKER_PORT, PROXY_PORT = 50051, 9003, 8080, 8100, 8000
_CLONE_NEWNET = 0x40000000
_Start = Callable[..., None]
"""start(name, host, *kvpool args): one process on one host."""


def ip(*args: str) -> None:
    """`ip ARGS`; KvpoolError with its stderr when it fails."""
    out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)
    if out.returncode != 0:
        raise KvpoolError(f"ip {' '.join(args)}: {out.stderr.strip()}")


@dataclass
class Host:
    index: int
    netns: str
    addr: str
    holder: subprocess.Popen[bytes] | None = None
    """Owns the host's mount namespace (its private /dev/shm)."""

    def argv(self, *cmd: str) -> list[str]:
        """`cmd` run on this host: its network and mount namespaces."""
        assert self.holder is not None
        return ["nsenter", "-t", str(self.holder.pid), "-m", "-n", "--", *cmd]


@dataclass
class Fabric:
    bridge_ns: str
    hosts: list[Host]

    def cut(self, index: int) -> None:
        ip("-n", self.bridge_ns, "link", "set", f"v{index}", "down")

    def heal(self, index: int) -> None:
        ip("-n", self.bridge_ns, "link", "set", f"v{index}", "up")


@contextmanager
def fabric(num_hosts: int, tag: str = "") -> Iterator[Fabric]:
    """`num_hosts` hosts on one bridge; KvpoolError when namespaces or mounts cannot be made
    (not root, no `ip`/`unshare`/`nsenter`)."""
    tag = tag or f"kvh{os.getpid()}"
    net = Fabric(f"{tag}-br", [Host(i, f"{tag}-{i}", f"{SUBNET}.{i + 1}")
                               for i in range(num_hosts)])
    with ExitStack() as stack:
        for ns in (net.bridge_ns, *(h.netns for h in net.hosts)):
            _add_netns(ns)
            stack.callback(subprocess.run, ["ip", "netns", "del", ns], capture_output=True)
        ip("-n", net.bridge_ns, "link", "add", "br0", "type", "bridge")
        ip("-n", net.bridge_ns, "link", "set", "br0", "up")
        for host in net.hosts:
            _plug(net.bridge_ns, host)
            host.holder = _hold_mounts(host.netns)
            stack.callback(stop, host.holder, 5.0)
        yield net


def _add_netns(ns: str) -> None:
    try:
        ip("netns", "add", ns)
    except FileNotFoundError as exc:
        raise KvpoolError("no `ip` command (iproute2)") from exc


def _plug(bridge_ns: str, host: Host) -> None:
    port = f"v{host.index}"
    ip("-n", bridge_ns, "link", "add", port, "type", "veth", "peer", "name", "eth0",
       "netns", host.netns)
    ip("-n", bridge_ns, "link", "set", port, "master", "br0", "up")
    ip("-n", host.netns, "link", "set", "lo", "up")
    ip("-n", host.netns, "addr", "add", f"{host.addr}/24", "dev", "eth0")
    ip("-n", host.netns, "link", "set", "eth0", "up")


def _hold_mounts(netns: str, timeout_s: float = 10.0) -> subprocess.Popen[bytes]:
    """A `sleep` in `netns` and a new mount namespace with a fresh tmpfs on /dev/shm; returned
    once the mount is made (the shell execs sleep only after it)."""
    script = "mount -t tmpfs -o size=1g,mode=1777 tmpfs /dev/shm && exec sleep infinity"
    proc = subprocess.Popen(["ip", "netns", "exec", netns, "unshare", "--mount",
                             "--propagation", "private", "sh", "-c", script],
                            preexec_fn=die_with_parent(os.getpid()), start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise KvpoolError(f"cannot give {netns} a private /dev/shm (unshare/mount failed)")
        try:
            if Path(f"/proc/{proc.pid}/comm").read_text().strip() == "sleep":
                return proc
        except OSError:
            pass
        time.sleep(0.02)
    stop(proc)
    raise KvpoolError(f"{netns}: the /dev/shm holder did not start within {timeout_s:.0f} s")


@contextmanager
def in_netns(netns: str) -> Iterator[None]:
    """The calling thread in network namespace `netns` for the block: sockets it opens there
    stay there. Other threads are not affected."""
    libc = ctypes.CDLL(None, use_errno=True)
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    target = os.open(f"/run/netns/{netns}", os.O_RDONLY)
    try:
        if libc.setns(target, _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {netns}")
        try:
            yield
        finally:
            if libc.setns(home, _CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns back home")
    finally:
        os.close(target)
        os.close(home)


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


@dataclass
class HostsCluster:
    fabric: Fabric
    token: str
    model_name: str
    master_address: str = ""
    metadata_url: str = ""
    admin_url: str = ""
    proxy_host: int = 0
    proxy_url: str = ""
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    worker_urls: dict[str, list[str]] = field(default_factory=dict)


@contextmanager
def hosts_cluster(spec: HostsSpec) -> Iterator[HostsCluster]:
    """The serving cluster of the module docstring over `spec.num_hosts` (>= 3) hosts."""
    if spec.num_hosts < 3:
        raise KvpoolError(f"a cluster over hosts needs at least 3 of them, not {spec.num_hosts}")
    token = spec.token or secrets.token_hex(16)
    with fabric(spec.num_hosts) as net, ExitStack() as stack:
        cluster = HostsCluster(net, token, served_name(spec.model_dir))
        env = {**os.environ, "KVPOOL_TOKEN": token}

        def start(name: str, host: Host, *args: str) -> None:
            proc = subprocess.Popen(host.argv(*kvpool_argv(*args)), env=env,
                                    stdout=subprocess.DEVNULL, start_new_session=True,
                                    preexec_fn=die_with_parent(os.getpid()))
            stack.callback(stop, proc)
            cluster.procs[name] = proc

        _start_store(cluster, spec, start)
        _start_serving(cluster, spec, start)
        yield cluster


def _start_store(cluster: HostsCluster, spec: HostsSpec, start: _Start) -> None:
    hosts = cluster.fabric.hosts
    a = hosts[0].addr
    start("master", hosts[0], "master", "--host", a, "--rpc-port", str(RPC_PORT),
          "--admin-port", str(ADMIN_PORT), "--metadata-port", str(METADATA_PORT), *spec.master_args)
    cluster.master_address = f"{a}:{RPC_PORT}"
    cluster.metadata_url = f"http://{a}:{METADATA_PORT}/metadata"
    cluster.admin_url = f"http://{a}:{ADMIN_PORT}"
    with in_netns(hosts[0].netns):
        wait_http(f"{cluster.admin_url}/health", [cluster.procs["master"]], "master")
    for host in hosts:
        start(f"store-node-{host.index}", host, "store-node", "--dram", spec.dram,
              "--master", cluster.master_address, "--host", host.addr,
              "--metadata", cluster.metadata_url)
    with in_netns(hosts[0].netns):
        wait_segments(cluster.admin_url, len(hosts), list(cluster.procs.values()),
                      token=cluster.token)


def _start_serving(cluster: HostsCluster, spec: HostsSpec, start: _Start) -> None:
    hosts = cluster.fabric.hosts
    flags: list[str] = []
    for host in hosts[1:]:
        role = "prefill" if host.index % 2 else "decode"
        url = f"http://{host.addr}:{WORKER_PORT}"
        start(f"{role}-{host.index}", host, "worker", "--role", role,
              "--model", str(spec.model_dir), "--host", host.addr, "--port", str(WORKER_PORT),
              "--master", cluster.master_address, *spec.worker_args)
        cluster.worker_urls.setdefault(role, []).append(url)
        flags += [f"--{role}", url]
    last = hosts[-1]
    procs = list(cluster.procs.values())
    for host in hosts[1:]:
        with in_netns(host.netns):
            wait_http(f"http://{host.addr}:{WORKER_PORT}/health", procs, "a worker", 120)
    start("proxy", last, "proxy", "--model", str(spec.model_dir), "--host", last.addr,
          "--port", str(PROXY_PORT), *flags, *spec.proxy_args)
    cluster.proxy_host, cluster.proxy_url = last.index, f"http://{last.addr}:{PROXY_PORT}"
    with in_netns(last.netns):
        wait_http(cluster.proxy_url + "/health", list(cluster.procs.values()),
                  "the serving cluster", timeout_s=120)
