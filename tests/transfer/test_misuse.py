"""Misuse with raw addresses raises a kvpool error on every path; it never crashes the process."""

from __future__ import annotations

import subprocess
import sys

from tests.support.procs import python_env

SCRIPT = """
import numpy as np
from kvpool.errors import KvpoolError
from kvpool.store.client.store_client import StoreClient
from kvpool.store.client.config import ClientConfig
from kvpool.store.config import MasterConfig, ReplicateConfig
from kvpool.store.master.server import MasterServer, MasterServerConfig
from kvpool.transfer import OpCode, TransferConfig, TransferEngine

BOGUS = 0x10  # never mapped: a memmove to or from it is SIGSEGV

def expect_error(what, call):
    try:
        call()
    except KvpoolError as exc:
        print(what, type(exc).__name__, flush=True)
    else:
        print(what, "no error", flush=True)

with TransferEngine(TransferConfig()) as engine:
    mine = engine.allocate_managed(4096)
    expect_error("copy_local-local", lambda: engine.copy_local(OpCode.READ, BOGUS, mine.addr, 64))
    expect_error("copy_local-target", lambda: engine.copy_local(OpCode.WRITE, mine.addr, BOGUS, 64))
    expect_error("write-own-segment", lambda: engine.write(engine.segment_name, BOGUS, mine.addr, 64))
    expect_error("read-own-segment", lambda: engine.read(engine.segment_name, BOGUS, mine.addr, 64))

server = MasterServerConfig(rpc_port=0, admin_port=0, enable_http_metadata=False)
master = MasterServer(server, MasterConfig()).start()
with StoreClient(ClientConfig(master=master.address, global_segment_size=1 << 20)) as me:
    (sid,) = me.segment_ids
    assert me.put("mine", b"m" * 100, ReplicateConfig(preferred_segment=sid)).ok
    print("get_into", me.get_into("mine", BOGUS, 100).code.name, flush=True)
    stray = np.zeros(100, dtype=np.uint8)  # mapped, but not registered
    print("put_from", me.put_from("other", stray.ctypes.data, 100,
                                  ReplicateConfig(preferred_segment=sid)).code.name, flush=True)
    assert me.get("mine").data == b"m" * 100
master.stop()
print("survived", flush=True)
"""


def test_unregistered_addresses_are_refused_instead_of_crashing() -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=python_env(), capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-2000:]}"
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines() if " " in line)
    assert lines == {
        "copy_local-local": "MemoryRegistrationError",
        "copy_local-target": "MemoryRegistrationError",
        "write-own-segment": "TransferError",
        "read-own-segment": "TransferError",
        "get_into": "INVALID_PARAMS",
        "put_from": "INVALID_PARAMS",
    }
    assert done.stdout.splitlines()[-1] == "survived"
