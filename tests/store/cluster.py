"""A real local store cluster for integration tests: `kvpool master` and `kvpool store-node`
processes on loopback ports, plus helpers for deterministic object contents."""

from __future__ import annotations

import hashlib
import subprocess
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

import httpx
import numpy as np

from tests.support.net import free_port, wait_port
from tests.support.procs import running, spawn_kvpool


def content(key: str, size: int) -> bytes:
    """The bytes every test stores under `key`: derived from the key, so readers can check."""
    seed = np.frombuffer(hashlib.blake2b(key.encode(), digest_size=64).digest(), np.uint8)
    return np.resize(seed, size).tobytes()


@dataclass
class Cluster:
    rpc_port: int
    admin_port: int
    master: subprocess.Popen[bytes]
    nodes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    def admin(self, path: str, **params: str) -> httpx.Response:
        return httpx.get(f"http://127.0.0.1:{self.admin_port}{path}", params=params,
                         timeout=10)

    def segments(self) -> list[dict[str, object]]:
        return list(self.admin("/segments").json())

    def wait_segments(self, count: int, timeout_s: float = 20.0) -> list[dict[str, object]]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            segs = self.segments()
            if len(segs) == count:
                return segs
            time.sleep(0.05)
        raise TimeoutError(f"expected {count} segments, have {self.segments()}")

    def check_integrity(self) -> None:
        reply = self.admin("/integrity")
        assert reply.status_code == 200, reply.text


@contextmanager
def store_cluster(num_nodes: int = 2, dram: str = "32MiB",
                  *master_flags: str) -> Iterator[Cluster]:
    rpc, admin = free_port(), free_port()
    with ExitStack() as stack:
        master = stack.enter_context(running(spawn_kvpool(
            "master", "--rpc_port", str(rpc), "--metrics_port", str(admin),
            "--no-http-metadata", *master_flags)))
        wait_port(rpc), wait_port(admin)
        cluster = Cluster(rpc, admin, master)
        for _ in range(num_nodes):
            node = stack.enter_context(running(spawn_kvpool(
                "store-node", "--dram", dram, "--master", cluster.address,
                "--heartbeat-interval", "0.2")))
            cluster.nodes.append(node)
        cluster.wait_segments(num_nodes)
        yield cluster
