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
    master_args: tuple[str, ...] = ()
    metadata: str = "P2PHANDSHAKE"
    """The segment directory nodes publish in (the master's embedded one, or none)."""
    stack: ExitStack | None = None

    def kill_master(self) -> None:
        self.master.kill()
        self.master.wait()

    def start_master(self) -> None:
        """A new master on the same ports (after kill_master)."""
        assert self.stack is not None
        self.master = self.stack.enter_context(running(spawn_kvpool(*self.master_args)))
        wait_port(self.rpc_port), wait_port(self.admin_port)

    def add_node(self, dram: str = "32MiB") -> subprocess.Popen[bytes]:
        assert self.stack is not None
        node = self.stack.enter_context(running(spawn_kvpool(
            "store-node", "--dram", dram, "--master", self.address,
            "--heartbeat-interval", "0.2", "--metadata", self.metadata)))
        self.nodes.append(node)
        return node

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
        """The master's integrity check passes (waiting out its 10% lock budget: 429)."""
        reply = self.admin("/integrity")
        for _ in range(20):
            if reply.status_code != 429:
                break
            time.sleep(min(2.0, float(reply.headers.get("retry-after", "0.1")) + 0.05))
            reply = self.admin("/integrity")
        assert reply.status_code == 200, reply.text


@contextmanager
def store_cluster(num_nodes: int = 2, dram: str = "32MiB", *master_flags: str,
                  http_metadata: bool = False) -> Iterator[Cluster]:
    """A master and `num_nodes` store nodes; with `http_metadata` the nodes publish their
    segments in the master's embedded directory (`cluster.metadata`)."""
    rpc, admin = free_port(), free_port()
    if http_metadata:
        meta_port = free_port()
        meta_flags: tuple[str, ...] = ("--metadata-port", str(meta_port))
        metadata = f"http://127.0.0.1:{meta_port}/metadata"
    else:
        meta_flags, metadata = ("--no-http-metadata",), "P2PHANDSHAKE"
    args = ("master", "--rpc_port", str(rpc), "--metrics_port", str(admin), *meta_flags,
            *master_flags)
    with ExitStack() as stack:
        master = stack.enter_context(running(spawn_kvpool(*args)))
        wait_port(rpc), wait_port(admin)
        cluster = Cluster(rpc, admin, master, master_args=args, metadata=metadata,
                          stack=stack)
        for _ in range(num_nodes):
            cluster.add_node(dram)
        cluster.wait_segments(num_nodes)
        yield cluster
