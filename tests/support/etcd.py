"""A real etcd server for tests (Debian package `etcd-server`), started by kvpool's own
launcher (kvpool.launch.etcd)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

from kvpool.launch.etcd import EtcdProcess


@contextmanager
def etcd_server() -> Iterator[str]:
    """Start etcd on loopback ports in a temp dir; yields 'host:port' of its client URL."""
    with ExitStack() as stack:
        yield EtcdProcess(stack, "kvpool-test").start(timeout_s=15.0).endpoint
