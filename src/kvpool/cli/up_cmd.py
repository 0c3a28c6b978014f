"""`kvpool up`: a whole local cluster in one command.

Starts a master (with the embedded HTTP metadata server) and N store nodes as separate
processes on loopback. With `--demo` it then runs a short workload through a pure client:
replicated puts and verified gets, zero-copy batches, a store node killed with SIGKILL while its
replicated objects stay readable, and finally the transfer benchmark; then it shuts down.
Without `--demo` it keeps the cluster up until Ctrl-C.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

import httpx

from kvpool.cli.security import add_security_args, bind_refusal, export_token
from kvpool.errors import KvpoolError


@dataclass
class LocalCluster:
    host: str
    rpc_port: int
    admin_port: int
    metadata_port: int
    master: subprocess.Popen[bytes]
    nodes: list[subprocess.Popen[bytes]] = field(default_factory=list)
    token: str | None = None

    @property
    def master_address(self) -> str:
        return f"{self.host}:{self.rpc_port}"

    @property
    def metadata_url(self) -> str:
        return f"http://{self.host}:{self.metadata_port}/metadata"

    def admin(self, path: str) -> httpx.Response:
        headers = {"authorization": f"Bearer {self.token}"} if self.token else None
        return httpx.get(f"http://{self.host}:{self.admin_port}{path}", timeout=10,
                         headers=headers)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("up", help="start a local cluster (master + store nodes); --demo runs a workload")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--store-nodes", type=int, default=2, help="store-node processes (default 2)")
    p.add_argument("--dram", default="256MiB", help="DRAM each store node contributes")
    p.add_argument("--rpc-port", type=int, default=0, help="master RPC port (0 = a free one)")
    p.add_argument("--admin-port", type=int, default=0, help="master admin HTTP port (0 = a free one)")
    p.add_argument("--metadata-port", type=int, default=0, help="embedded metadata port (0 = a free one)")
    p.add_argument("--demo", action="store_true", help="run the demo workload, then shut down")
    p.add_argument("--no-bench", action="store_true", help="with --demo: skip the transfer benchmark")
    add_security_args(p, "every process of the cluster requires")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.store_nodes < 1:
        print("kvpool up: --store-nodes must be >= 1", file=sys.stderr)
        return 2
    refusal = bind_refusal("up", args.host, args.token, args.insecure)
    if refusal is not None:
        print(refusal, file=sys.stderr)
        return 2
    export_token(args.token)  # the demo's client, and the children, read it
    try:
        with local_cluster(args.host, args.store_nodes, args.dram, args.rpc_port,
                           args.admin_port, args.metadata_port, args.token,
                           args.insecure) as cluster:
            _print_endpoints(cluster)
            if args.demo:
                from kvpool.cli.demo import run_demo

                return run_demo(cluster, bench=not args.no_bench)
            _wait_for_interrupt(cluster)
            return 0
    except (KvpoolError, OSError, TimeoutError) as exc:
        print(f"kvpool up: {exc}", file=sys.stderr)
        return 1


@contextmanager
def local_cluster(host: str, num_nodes: int, dram: str, rpc_port: int = 0, admin_port: int = 0,
                  metadata_port: int = 0, token: str | None = None,
                  insecure: bool = False) -> Iterator[LocalCluster]:
    rpc, admin, meta = (p or _free_port(host) for p in (rpc_port, admin_port, metadata_port))
    security = (["--token", token] if token else []) + (["--insecure"] if insecure else [])
    with ExitStack() as stack:
        master = _start(stack, "master", "--host", host, "--rpc-port", str(rpc),
                        "--admin-port", str(admin), "--metadata-port", str(meta), *security)
        cluster = LocalCluster(host, rpc, admin, meta, master, token=token)
        _wait_http(cluster, "/health", master)
        for _ in range(num_nodes):
            cluster.nodes.append(_start(stack, "store-node", "--dram", dram, "--master",
                                        cluster.master_address, "--host", host,
                                        "--metadata", cluster.metadata_url, *security))
        _wait_segments(cluster, num_nodes)
        yield cluster


def _start(stack: ExitStack, *args: str) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-m", "kvpool", "--log-level", "WARNING", *args],
                            stdout=subprocess.DEVNULL)
    stack.callback(_stop, proc)
    return proc


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _wait_http(cluster: LocalCluster, path: str, proc: subprocess.Popen[bytes], timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise KvpoolError(f"the master exited with code {proc.returncode} (ports busy?)")
        try:
            if cluster.admin(path).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"the master did not answer {path} within {timeout_s}s")


def _wait_segments(cluster: LocalCluster, count: int, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for node in cluster.nodes:
            if node.poll() is not None:
                raise KvpoolError(f"a store node exited with code {node.returncode}")
        if len(cluster.admin("/segments").json()) >= count:
            return
        time.sleep(0.1)
    raise TimeoutError(f"{count} store nodes did not mount within {timeout_s}s")


def _print_endpoints(cluster: LocalCluster) -> None:
    print(f"kvpool cluster up (pid {os.getpid()}):")
    print(f"  master RPC     {cluster.master_address}")
    print(f"  metadata       {cluster.metadata_url}")
    print(f"  admin/metrics  http://{cluster.host}:{cluster.admin_port}/metrics")
    print(f"  store nodes    {len(cluster.nodes)}", flush=True)


def _wait_for_interrupt(cluster: LocalCluster) -> None:
    print("Ctrl-C to stop.", flush=True)
    try:
        while all(p.poll() is None for p in (cluster.master, *cluster.nodes)):
            time.sleep(0.5)
        print("kvpool up: a cluster process exited; shutting down", file=sys.stderr)
    except KeyboardInterrupt:
        pass
