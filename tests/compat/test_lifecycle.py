"""Life cycle of the compat objects with real processes: a store or engine that is dropped,
or still alive at a normal interpreter exit, unmounts its segment and unpublishes itself at
once (as Mooncake's destructors do), not after the master's client_ttl; `close()` is
idempotent and bounded. The master's `/get_all_segments` is read the way SGLang's
`check_server` reads it."""

from __future__ import annotations

import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest

from kvpool.compat.mooncake.engine import TransferEngine
from kvpool.compat.mooncake.lifecycle import CLOSE_BOUND_S
from kvpool.compat.mooncake.store import MooncakeDistributedStore
from kvpool.transfer.segment import segment_key
from tests.support.net import free_port, wait_port
from tests.support.procs import running, spawn_kvpool, spawn_python, stop

MIB = 1 << 20


@dataclass(frozen=True)
class Master:
    rpc: int
    admin: int
    meta: int

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.rpc}"

    @property
    def metadata(self) -> str:
        return f"http://127.0.0.1:{self.meta}/metadata"

    def segments(self) -> str:
        """What SGLang's check_server reads."""
        url = f"http://127.0.0.1:{self.admin}/get_all_segments"
        with urllib.request.urlopen(url, timeout=5) as reply:
            return str(reply.read().decode())

    def published(self, name: str) -> bool:
        url = f"{self.metadata}?key={segment_key(name)}"
        try:
            with urllib.request.urlopen(url, timeout=5):
                return True
        except urllib.error.HTTPError as exc:
            assert exc.code == 404
            return False


@contextmanager
def master_with_admin(*extra: str) -> Iterator[Master]:
    """A `kvpool master` with Mooncake's flags, HTTP metadata on and its admin port known."""
    rpc, admin, meta = free_port(), free_port(), free_port()
    proc = spawn_kvpool("master", f"--rpc_port={rpc}", f"--metrics_port={admin}",
                        "--enable_http_metadata_server=true",
                        f"--http_metadata_server_port={meta}", *extra)
    with running(proc):
        wait_port(rpc), wait_port(admin), wait_port(meta)
        yield Master(rpc, admin, meta)


@pytest.fixture(scope="module")
def master() -> Iterator[Master]:
    """client_ttl 30 s: anything that disappears within the tests' waits was torn down by
    its owner, not expired by the master."""
    with master_with_admin("--client_ttl=30") as m:
        yield m


_CHILD = """
import gc, sys
from mooncake_under_test import MooncakeDistributedStore, TransferEngine
master, metadata, mode = sys.argv[1], sys.argv[2], sys.argv[3]

class Backend:                      # SGLang's MooncakeStore, reduced to what it does here
    def __init__(self):
        self.store = MooncakeDistributedStore()
        assert self.store.setup("127.0.0.1", metadata, 16 << 20, 16 << 20, "tcp", "",
                                master, None) == 0
        assert self.store.put("warmup", bytes(4096)) == 0
        assert self.store.is_exist("warmup") == 1 and self.store.get("warmup") == bytes(4096)
        assert self.store.remove("warmup", True) == 0
    def close(self):
        pass                        # "the destructor does it"

backend = Backend()
engine = TransferEngine()
assert engine.initialize("127.0.0.1", metadata, "tcp", "") == 0
print(backend.store.get_hostname(), f"127.0.0.1:{engine.get_rpc_port()}", flush=True)
sys.stdin.readline()
if mode == "drop":                  # detach_storage_backend: close(), then drop it
    backend.close()
    backend = None
    engine = None
    gc.collect()
    print("dropped", flush=True)
    sys.stdin.readline()
# mode "exit": leave both alive and let the interpreter exit normally
"""


def _child(master: Master, mode: str) -> tuple[subprocess.Popen[bytes], str, str]:
    code = _CHILD.replace(
        "from mooncake_under_test import MooncakeDistributedStore, TransferEngine",
        "from kvpool.compat.mooncake.store import MooncakeDistributedStore\n"
        "from kvpool.compat.mooncake.engine import TransferEngine")
    proc = spawn_python(code, master.address, master.metadata, mode)
    assert proc.stdout is not None
    store_name, engine_name = proc.stdout.readline().decode().split()
    return proc, store_name, engine_name


def _say(proc: subprocess.Popen[bytes]) -> None:
    assert proc.stdin is not None
    proc.stdin.write(b"go\n")
    proc.stdin.flush()


def test_empty_pool_lists_nothing(master: Master) -> None:
    assert master.segments() == ""  # check_server keeps waiting, as on Mooncake


def test_dropped_store_and_engine_are_torn_down(master: Master) -> None:
    proc, store_name, engine_name = _child(master, "drop")
    try:
        assert master.segments() == f"{store_name}\n"
        assert master.published(engine_name)
        _say(proc)
        assert proc.stdout is not None and proc.stdout.readline() == b"dropped\n"
        assert master.segments() == ""  # the process lives on; its segment is gone
        assert not master.published(engine_name) and not master.published(store_name)
    finally:
        _say(proc)
        stop(proc)


def test_interpreter_exit_unmounts_before_client_ttl(master: Master) -> None:
    proc, store_name, engine_name = _child(master, "exit")
    other = MooncakeDistributedStore()
    assert other.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 * MIB, "tcp", "",
                       master.address) == 0
    try:
        assert master.segments() == f"{store_name}\n"
        _say(proc)
        assert proc.wait(15) == 0
        assert master.segments() == ""
        assert not master.published(engine_name)
        # the reported symptom: puts that would land on the dead segment failed with -800
        assert other.put("after-exit", b"x") == -200  # no space anywhere, nothing broken
        mounted = MooncakeDistributedStore()
        assert mounted.setup("127.0.0.1", "P2PHANDSHAKE", 16 * MIB, 16 * MIB, "tcp", "",
                             master.address) == 0
        assert [other.put(f"k{i}", bytes(1024)) for i in range(40)] == [0] * 40
        assert mounted.remove_all(True) == 40 and mounted.close() == 0
    finally:
        other.close()
        stop(proc)


def test_close_is_idempotent_and_bounded(master: Master) -> None:
    store = MooncakeDistributedStore()
    assert store.setup("127.0.0.1", "P2PHANDSHAKE", 8 * MIB, 8 * MIB, "tcp", "",
                       master.address) == 0
    name = store.get_hostname()
    assert name in master.segments()
    start = time.monotonic()
    assert [store.close(), store.close()] == [0, 0]
    assert time.monotonic() - start < CLOSE_BOUND_S
    assert name not in master.segments()
    assert store.health_check() == 1
    engine = TransferEngine()
    assert engine.initialize("127.0.0.1", master.metadata, "tcp", "") == 0
    engine_name = f"127.0.0.1:{engine.get_rpc_port()}"
    engine.close()
    engine.close()
    assert not master.published(engine_name)


def test_close_after_master_died_is_bounded() -> None:
    rpc, admin = free_port(), free_port()
    proc = spawn_kvpool("master", f"--rpc_port={rpc}", f"--metrics_port={admin}")
    with running(proc):
        wait_port(rpc)
        store = MooncakeDistributedStore()
        assert store.setup("127.0.0.1", "P2PHANDSHAKE", 8 * MIB, 8 * MIB, "tcp", "",
                           f"127.0.0.1:{rpc}") == 0
        proc.kill()
        proc.wait()
    start = time.monotonic()
    assert store.close() == 0
    assert time.monotonic() - start <= CLOSE_BOUND_S + 1
    assert store.close() == 0


_FORKS = """
import os, sys
from kvpool.compat.mooncake.store import MooncakeDistributedStore
store = MooncakeDistributedStore()
assert store.setup("127.0.0.1", "P2PHANDSHAKE", 8 << 20, 8 << 20, "tcp", "", sys.argv[1]) == 0
print(store.get_hostname(), flush=True)
if os.fork() == 0:
    sys.exit(0)             # a child exiting normally runs the inherited finalizers
os.wait()
print("child gone", flush=True)
sys.stdin.readline()
"""


def test_forked_child_leaves_the_parents_segment(master: Master) -> None:
    proc = spawn_python(_FORKS, master.address)
    try:
        assert proc.stdout is not None
        name = proc.stdout.readline().decode().strip()
        assert proc.stdout.readline() == b"child gone\n"
        assert master.segments() == f"{name}\n"
    finally:
        _say(proc)
        stop(proc)
