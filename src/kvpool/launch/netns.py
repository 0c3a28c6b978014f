"""Emulated hosts on one Linux machine (needs root): each host a network namespace with one
address on a bridge, and a mount namespace with a /dev/shm of its own (a tmpfs), so shm works
within a host and never across hosts, as on real machines. The bridge lives in a namespace of
its own: nothing is added to the caller's.

    netns <tag>-br:  br0 -- v0 -- v1 -- v2 ...  (veth ends, one per host)
                           |     |     |
    netns <tag>-i:   eth0 10.231.60.i+1

The addresses exist only inside these namespaces. A host's processes are started through
`nsenter` into a holder process (`sleep`) that owns the host's mount namespace
(`Host.spawn`). `Fabric.cut(i)` takes host i's port on the bridge down (its link is dead, its
processes keep running); `heal(i)` brings it back. This process reaches a host's servers by
switching one thread into the host's network namespace (`in_netns`). Everything is stopped and
deleted on exit, failures included. What runs on which host is the caller's
(kvpool.serve.hosts).
"""

from __future__ import annotations

import ctypes
import os
import subprocess
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

from kvpool.errors import KvpoolError
from kvpool.launch.children import die_with_parent, stop
from kvpool.launch.wait import wait_for

SUBNET = "10.231.60"
_CLONE_NEWNET = 0x40000000


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

    def spawn(self, argv: Sequence[str], env: Mapping[str, str], quiet: bool = False,
              pass_fds: Sequence[int] = ()) -> subprocess.Popen[bytes]:
        """`argv` on this host as a child that dies with this process, in a session of its
        own, with environment `env`; stdout discarded, and stderr too when `quiet`;
        `pass_fds` stay open in it (nsenter passes them on: a readiness pipe's write end)."""
        return subprocess.Popen(self.argv(*argv), env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL if quiet else None,
                                start_new_session=True, preexec_fn=die_with_parent(os.getpid()),
                                pass_fds=pass_fds)


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

    def sleeping() -> bool:
        if proc.poll() is not None:
            raise KvpoolError(f"cannot give {netns} a private /dev/shm (unshare/mount failed)")
        try:
            return Path(f"/proc/{proc.pid}/comm").read_text().strip() == "sleep"
        except OSError:
            return False

    try:
        wait_for(sleeping, timeout_s, f"{netns}'s /dev/shm holder")
    except TimeoutError:
        stop(proc)
        raise KvpoolError(f"{netns}: the /dev/shm holder did not start within "
                          f"{timeout_s:.0f} s") from None
    return proc


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
