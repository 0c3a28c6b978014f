"""A real local store cluster for integration tests: `kvpool master` and `kvpool store-node`
processes on loopback ports, started by kvpool's own launcher (kvpool.launch.store: children
that die with the test process; the master waited for until it says it is ready), plus
helpers for deterministic object contents."""

from __future__ import annotations

import hashlib
import subprocess
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

import httpx
import numpy as np

from kvpool.launch.ports import free_port
from kvpool.launch.store import owned, spawn_kvpool, start_ready
from kvpool.launch.wait import wait_for

LOG_LEVEL = "WARNING"
"""The children's, as every test child's (tests.support.procs.python_env); their output is
the test's."""
STOP_TIMEOUT_S = 10.0
"""SIGKILL a child this long after SIGTERM when the cluster closes."""


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
        """A new master on the same ports (after kill_master), once it says it serves."""
        assert self.stack is not None
        self.master = _start_master(self.stack, self.master_args)

    def add_node(self, dram: str = "32MiB") -> subprocess.Popen[bytes]:
        return self.start_node("--dram", dram, "--master", self.address,
                               "--heartbeat-interval", "0.2", "--metadata", self.metadata)

    def start_node(self, *args: str) -> subprocess.Popen[bytes]:
        """`kvpool store-node ARGS`, one of `nodes` (not waited for: see wait_segments)."""
        assert self.stack is not None
        node = owned(self.stack, spawn_kvpool("store-node", *args, quiet=False,
                                              log_level=LOG_LEVEL), STOP_TIMEOUT_S)
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
        """The mounted segments once there are exactly `count`; TimeoutError naming those
        there are."""
        def exactly() -> tuple[list[dict[str, object]]] | None:
            segs = self.segments()
            return (segs,) if len(segs) == count else None  # (segs,): true when none

        return wait_for(exactly, timeout_s, lambda: f"{count} segments, have {self.segments()}",
                        0.05)[0]

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
        master = _start_master(stack, args)
        cluster = Cluster(rpc, admin, master, master_args=args, metadata=metadata,
                          stack=stack)
        for _ in range(num_nodes):
            cluster.add_node(dram)
        cluster.wait_segments(num_nodes)
        yield cluster


def _start_master(stack: ExitStack, args: tuple[str, ...]) -> subprocess.Popen[bytes]:
    """`kvpool ARGS` (a master), once it says it serves (RPC and admin listening)."""
    return start_ready(stack, *args, what="the master", quiet=False, log_level=LOG_LEVEL,
                       stop_timeout_s=STOP_TIMEOUT_S)
