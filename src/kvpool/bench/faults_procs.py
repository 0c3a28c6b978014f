"""Real processes for the fault benchmark and the fault tests: an etcd that can be killed and
started again on the same ports and data, `kvpool master` / `kvpool store-node` children, and
a ledger of acknowledged objects that checks every byte read back.

Everything binds loopback ports; every child is stopped when its ExitStack closes.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpool.launch.children import stop
from kvpool.launch.ports import free_port
from kvpool.launch.wait import wait_port
from kvpool.store.client.config import ClientConfig
from kvpool.store.client.store_client import StoreClient
from kvpool.store.config import ReplicateConfig
from kvpool.store.wire.codes import ErrorCode as E


def content(key: str, size: int) -> bytes:
    """The bytes stored under `key`: derived from the key alone, so any reader can check them."""
    seed = hashlib.blake2b(key.encode(), digest_size=64).digest()
    return (seed * (size // 64 + 1))[:size]


def tally_reads(store: Any, keys: list[str], size: int) -> dict[str, Any]:
    """Read each of `keys` with `store.get`: the count of each result code, and how many
    reads were OK but not `content(key, size)` (must be 0)."""
    codes: dict[str, int] = {}
    wrong = 0
    for key in keys:
        got = store.get(key)
        codes[got.code.name] = codes.get(got.code.name, 0) + 1
        wrong += bool(got.ok and got.data != content(key, size))
    return {"codes": codes, "wrong": wrong}


def spawn_kvpool(*args: str, quiet: bool = True) -> subprocess.Popen[bytes]:
    """`python -m kvpool args...` as its own process (stdout discarded when `quiet`)."""
    env = dict(os.environ)
    env.setdefault("KVPOOL_LOG_LEVEL", "ERROR")
    here = str(Path(__file__).resolve().parents[2])   # children run this very kvpool
    env["PYTHONPATH"] = here + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.DEVNULL if quiet else None
    return subprocess.Popen([sys.executable, "-m", "kvpool", *args], env=env, stdout=out,
                            stderr=subprocess.DEVNULL if quiet else None)


def owned(stack: ExitStack, proc: subprocess.Popen[bytes]) -> subprocess.Popen[bytes]:
    """Stop `proc` (SIGTERM, then SIGKILL) when `stack` closes."""
    stack.callback(stop, proc, 5.0)
    return proc


class EtcdProcess:
    """A one-member etcd on loopback that keeps its ports and data across `kill`/`start`."""

    def __init__(self, stack: ExitStack) -> None:
        binary = shutil.which("etcd")
        if binary is None:
            raise RuntimeError("etcd is not installed (Debian package etcd-server)")
        self.binary = binary
        self.data_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvp-etcd-"))
        self.client_port, self.peer_port = free_port(), free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        stack.callback(self.kill, signal.SIGTERM)

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def start(self) -> EtcdProcess:
        peer = f"http://127.0.0.1:{self.peer_port}"
        client = f"http://127.0.0.1:{self.client_port}"
        self.proc = subprocess.Popen(
            [self.binary, "--name", "kvp", "--data-dir", self.data_dir,
             "--listen-client-urls", client, "--advertise-client-urls", client,
             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"kvp={peer}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_port(self.client_port, timeout_s=30)
        return self

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None:
            stop(self.proc, 10.0, sig)
            self.proc = None


@dataclass
class HaPair:
    """Two HA masters on one etcd (journaling there, or to one shared state directory)."""

    etcd: EtcdProcess
    masters: list[subprocess.Popen[bytes]]
    rpc_ports: list[int]
    admin_ports: list[int]
    cluster_id: str

    @property
    def address(self) -> str:
        return f"etcd://{self.etcd.endpoint}/{self.cluster_id}"

    def client_config(self) -> ClientConfig:
        """A client that follows the leader through etcd and gives up on a dead one fast."""
        return ClientConfig(master=self.address, rpc_timeout_s=1.0, transfer_timeout_s=3.0)

    def index_of(self, leader_address: str) -> int:
        return next(i for i, p in enumerate(self.rpc_ports) if leader_address.endswith(f":{p}"))


def start_ha_pair(stack: ExitStack, etcd: EtcdProcess, state_dir: Path | None, cluster_id: str,
                  ttl_s: int = 2) -> HaPair:
    """Two HA masters journaling to `state_dir`, or to etcd itself when None."""
    pair = HaPair(etcd, [], [], [], cluster_id)
    shared = ["--state-dir", str(state_dir)] if state_dir is not None else []
    for _ in range(2):
        rpc, admin = free_port(), free_port()
        pair.masters.append(owned(stack, spawn_kvpool(
            "master", "--enable_ha=true", f"--etcd_endpoints={etcd.endpoint}",
            "--cluster_id", cluster_id, *shared,
            "--rpc_port", str(rpc), "--metrics_port", str(admin), "--no-http-metadata",
            "--ha-lease-ttl", str(ttl_s), "--recovery-grace", "20")))
        pair.rpc_ports.append(rpc)
        pair.admin_ports.append(admin)
    return pair


def start_master(stack: ExitStack, *flags: str) -> tuple[subprocess.Popen[bytes], str, list[str]]:
    """A plain master on fresh ports: (process, rpc address, its argv for a restart)."""
    rpc, admin = free_port(), free_port()
    argv = ["master", "--rpc_port", str(rpc), "--metrics_port", str(admin),
            "--no-http-metadata", *flags]
    proc = owned(stack, spawn_kvpool(*argv))
    wait_port(rpc, timeout_s=30)
    return proc, f"127.0.0.1:{rpc}", argv


def start_nodes(stack: ExitStack, master: str, count: int, dram: str = "16MiB",
                *extra: str) -> list[subprocess.Popen[bytes]]:
    return [owned(stack, spawn_kvpool("store-node", "--dram", dram, "--master", master,
                                      "--heartbeat-interval", "0.2", *extra))
            for _ in range(count)]


@dataclass
class Ledger:
    """Objects whose put was acknowledged, and every outcome seen on the way."""

    prefix: str
    acked: dict[str, int] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)
    wrong_bytes: int = 0
    next_index: int = 0

    def note_error(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1

    def put_one(self, store: StoreClient, replicas: int = 1) -> bool:
        """Put a fresh key and read it back; True when the put was acknowledged."""
        key = f"{self.prefix}-{self.next_index}"
        size = 1000 + (self.next_index % 64) * 97
        self.next_index += 1
        res = store.put(key, content(key, size), ReplicateConfig(replica_num=replicas))
        if not res.ok:
            self.note_error(f"put:{res.code.name}")
            return False
        self.acked[key] = size
        got = store.get(key)
        if got.ok and got.data != content(key, size):
            self.wrong_bytes += 1
        elif not got.ok:
            self.note_error(f"get:{got.code.name}")
        return True

    def get_one(self, store: StoreClient, n: int) -> bool:
        """Read the n-th acknowledged object (modulo their number) and check its bytes."""
        keys = list(self.acked)
        key = keys[n % len(keys)]
        got = store.get(key)
        if not got.ok:
            self.note_error(f"get:{got.code.name}")
        elif got.data != content(key, self.acked[key]):
            self.wrong_bytes += 1
        return got.ok

    def put_until(self, store: StoreClient, count: int, timeout_s: float = 60.0,
                  replicas: int = 1) -> float | None:
        """Put until `count` more are acknowledged; monotonic time of the first one."""
        first, done, deadline = None, 0, time.monotonic() + timeout_s
        while done < count and time.monotonic() < deadline:
            if self.put_one(store, replicas):
                done += 1
                first = first or time.monotonic()
            else:
                time.sleep(0.01)
        return first

    def check_all(self, store: StoreClient, timeout_s: float = 30.0) -> tuple[int, int]:
        """(lost, wrong): wait up to `timeout_s` for every acknowledged object to read back;
        count those that never did and those read with other bytes."""
        keys = sorted(self.acked)
        deadline = time.monotonic() + timeout_s
        while True:
            got = store.get_batch(keys)
            if all(g.ok for g in got) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        return lost_and_wrong(keys, [g.code for g in got], [g.data for g in got], self.acked)


def lost_and_wrong(keys: Sequence[str], codes: Sequence[E], data: Sequence[bytes | None],
                   sizes: dict[str, int]) -> tuple[int, int]:
    lost = sum(1 for c in codes if c != E.OK)
    wrong = sum(1 for k, c, d in zip(keys, codes, data, strict=True)
                if c == E.OK and d != content(k, sizes[k]))
    return lost, wrong


def wait_until(predicate: Callable[[], bool], timeout_s: float, step_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step_s)
    return False


class PutLoad(threading.Thread):
    """Puts (and reads back) fresh keys on `ledger` until `stop_event`; once `max_objects`
    are acknowledged it reads old ones instead (so the pool never evicts). The times of every
    successful and every failed operation."""

    def __init__(self, store: StoreClient, ledger: Ledger, max_objects: int = 1500) -> None:
        super().__init__(daemon=True, name="faults-load")
        self.store, self.ledger, self.max_objects = store, ledger, max_objects
        self.stop_event = threading.Event()
        self.failures: list[float] = []
        self.successes: list[float] = []

    def run(self) -> None:
        n = 0
        while not self.stop_event.is_set():
            n += 1
            if len(self.ledger.acked) < self.max_objects:
                ok = self.ledger.put_one(self.store)
            else:
                ok = self.ledger.get_one(self.store, n)
            (self.successes if ok else self.failures).append(time.monotonic())
            if not ok:
                time.sleep(0.01)
