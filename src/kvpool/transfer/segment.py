"""Segment descriptors: what a peer publishes about itself (directory value, handshake reply)."""

from __future__ import annotations

import functools
import json
import os
import select
import socket
import threading
from dataclasses import dataclass
from typing import Any

from kvpool.errors import InvalidArgument, RemoteProtocolError
from kvpool.transfer.memory import pid_namespace

SEGMENT_KEY_PREFIX = "kvpool/segments/"


def segment_key(name: str) -> str:
    """Directory key of a segment; the same on every metadata backend."""
    return SEGMENT_KEY_PREFIX + name


@functools.cache
def host_identity() -> str:
    """Same value for every process that can map this process's /dev/shm files and watch its
    pids, different for any other: the boot id, the identity (device, inode) of the /dev/shm
    directory and the pid namespace.

    Not the hostname: network namespaces (and containers sharing the host's UTS namespace)
    all report the machine's hostname, yet each may mount a /dev/shm of its own; a peer in one
    of them is another host for shm, whose files a copy here would never find. Two processes
    of one machine that see the same /dev/shm but other pid namespaces are kept apart too,
    since a peer's liveness is checked by its pid.
    """
    return f"{_read_boot_id()}/{_shm_identity('/dev/shm')}/{pid_namespace():x}"


def _read_boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return f"unknown-{socket.gethostname()}"


def _shm_identity(directory: str) -> str:
    """Device and inode of `directory`: equal for every mount namespace that shares the mount
    (a tmpfs gets its own device number when mounted)."""
    try:
        info = os.stat(directory)
    except OSError:
        return "no-shm"
    return f"{info.st_dev:x}:{info.st_ino:x}"


def parse_segment_name(name: str) -> tuple[str, int]:
    """Split "host:port" (IPv6 as "[::1]:port")."""
    host, sep, port = name.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise InvalidArgument(f"segment name must be 'host:port', got {name!r}")
    return host.strip("[]"), int(port)


@dataclass(frozen=True)
class ShmRegion:
    addr: int
    length: int
    name: str


@dataclass(frozen=True)
class SegmentDescriptor:
    name: str
    host: str
    port: int
    host_id: str
    pid: int
    shm_regions: tuple[ShmRegion, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "host": self.host, "port": self.port,
            "host_id": self.host_id, "pid": self.pid,
            "shm": [[r.addr, r.length, r.name] for r in self.shm_regions],
        }

    def to_json(self) -> bytes:
        return json.dumps(self.to_dict(), separators=(",", ":")).encode()

    @classmethod
    def from_dict(cls, body: dict[str, Any]) -> SegmentDescriptor:
        try:
            regions = tuple(ShmRegion(int(a), int(n), str(s)) for a, n, s in body.get("shm", []))
            return cls(str(body["name"]), str(body["host"]), int(body["port"]),
                       str(body["host_id"]), int(body["pid"]), regions)
        except (KeyError, TypeError, ValueError) as exc:
            raise RemoteProtocolError(f"malformed segment descriptor: {exc!r}") from None

    @classmethod
    def from_json(cls, raw: bytes) -> SegmentDescriptor:
        try:
            return cls.from_dict(json.loads(raw))
        except ValueError as exc:
            raise RemoteProtocolError(f"segment descriptor is not JSON: {exc}") from None

    def same_host(self) -> bool:
        return self.host_id == host_identity()


def readable_now(fd: int) -> bool:
    """Whether `fd` is readable (or closed/errored) right now. poll, not select: select fails
    for fds >= 1024, which a process with many open files hands out."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(0))


def pid_exists(pid: int) -> bool:
    """Whether a process with this pid exists on this host (zombies included)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class ProcessWatch:
    """Cheap repeated liveness checks of a same-host process through a pidfd, which becomes
    readable when the process exits (so an unreaped zombie counts as dead)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._lock = threading.Lock()
        self._poller = select.poll()  # kept: asking it again is one syscall, no allocation
        try:
            self._fd: int | None = os.pidfd_open(pid)
            self._poller.register(self._fd, select.POLLIN)
        except (OSError, AttributeError):
            self._fd = None
        self._dead = self._fd is None and not pid_exists(pid)

    def alive(self) -> bool:
        if self._dead:
            return False
        with self._lock:
            if self._dead:
                return False
            if self._fd is None:
                return pid_exists(self.pid)
            if self._poller.poll(0):
                self._dead = True
                self._poller.unregister(self._fd)
                os.close(self._fd)
                self._fd = None
            return not self._dead

    def __del__(self) -> None:
        if getattr(self, "_fd", None) is not None:
            os.close(self._fd)  # type: ignore[arg-type]
