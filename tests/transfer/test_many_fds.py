"""A process with thousands of open files (fds >= 1024) still transfers over tcp and shm."""

from __future__ import annotations

import hashlib
import subprocess
import sys

from tests.support.procs import python_env
from tests.transfer.conftest import Target

CLIENT = """
import os, resource, sys
import numpy as np
from kvpool.transfer import TransferConfig, TransferEngine

segment, plain, managed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (min(max(soft, 4096), hard), hard))
held = [os.open("/dev/null", os.O_RDONLY) for _ in range(2000)]
assert held[-1] >= 1024
for protocol, remote in (("tcp", plain), ("auto", managed)):
    with TransferEngine(TransferConfig(protocol=protocol, timeout_s=5.0)) as engine:
        local = engine.allocate_managed(1 << 16)
        for round in range(3):  # later rounds reuse idle connections / the peer watch
            local.numpy()[:] = round + 1
            engine.write(segment, local.addr, remote, 1 << 16)
            engine.read(segment, local.addr, remote, 1 << 16)
print("ok", flush=True)
"""


def test_transfers_from_a_process_with_fds_above_1024(target: Target) -> None:
    done = subprocess.run([sys.executable, "-c", CLIENT, target.segment, str(target.plain), str(target.managed)],
                          env=python_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "ok"
    expected = hashlib.sha256(bytes([3]) * (1 << 16)).hexdigest()
    assert target.digest(target.plain, 1 << 16) == expected
    assert target.digest(target.managed, 1 << 16) == expected
