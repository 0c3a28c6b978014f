"""A real etcd server for tests (Debian package `etcd-server`)."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

from tests.support.net import free_port, wait_port


@contextmanager
def etcd_server() -> Iterator[str]:
    """Start etcd on loopback ports in a temp dir; yields 'host:port' of its client URL."""
    binary = shutil.which("etcd")
    if binary is None:
        raise RuntimeError("etcd is not installed: run ./scripts/setup.sh (apt package etcd-server)")
    client_port, peer_port = free_port(), free_port()
    with tempfile.TemporaryDirectory(prefix="kvpool-etcd-") as data_dir:
        proc = subprocess.Popen(
            [
                binary, "--name", "kvpool-test", "--data-dir", data_dir,
                "--listen-client-urls", f"http://127.0.0.1:{client_port}",
                "--advertise-client-urls", f"http://127.0.0.1:{client_port}",
                "--listen-peer-urls", f"http://127.0.0.1:{peer_port}",
                "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer_port}",
                "--initial-cluster", f"kvpool-test=http://127.0.0.1:{peer_port}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            wait_port(client_port)
            yield f"127.0.0.1:{client_port}"
        finally:
            proc.terminate()
            proc.wait(10)
