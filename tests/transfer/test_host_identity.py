"""Same-host detection and the route counters.

Two processes are on the same host for shm only when they see the same /dev/shm (and the same
pids): network namespaces share the hostname and the boot id, so neither may decide it. A child
in a mount namespace with a tmpfs of its own on /dev/shm must get another identity than ours;
engines in one process move bytes by shm (or tcp when told), and say so in `traffic()`."""

from __future__ import annotations

import subprocess
import sys

from kvpool.transfer import TransferConfig, TransferEngine
from kvpool.transfer.batch import OpCode, TransferRequest
from kvpool.transfer.segment import _shm_identity, host_identity
from kvpool.transfer.traffic import RouteCount
from tests.support.procs import python_env
from tests.support.require import missing

PRINT_IDENTITY = "from kvpool.transfer.segment import host_identity; print(host_identity())"


def test_identity_names_the_shm_filesystem(tmp_path) -> None:  # type: ignore[no-untyped-def]
    assert _shm_identity("/dev/shm") in host_identity()
    assert _shm_identity(str(tmp_path / "none")) == "no-shm"
    out = subprocess.run([sys.executable, "-c", PRINT_IDENTITY], env=python_env(),
                         capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == host_identity()  # same /dev/shm, same pid namespace


def test_a_private_dev_shm_is_another_host() -> None:
    script = f"mount -t tmpfs tmpfs /dev/shm && exec {sys.executable} -c '{PRINT_IDENTITY}'"
    try:
        out = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                              script], env=python_env(), capture_output=True, text=True,
                             timeout=60)
    except FileNotFoundError:
        missing("no unshare(1) (util-linux)")
    if out.returncode != 0:
        missing(f"cannot make a mount namespace with its own /dev/shm: {out.stderr.strip()}")
    other = out.stdout.strip()
    assert other and other != host_identity()
    assert other.split("/")[0] == host_identity().split("/")[0]  # same boot, other /dev/shm


def test_traffic_counts_each_route() -> None:
    with TransferEngine(TransferConfig()) as owner, \
            TransferEngine(TransferConfig()) as shm_writer, \
            TransferEngine(TransferConfig(protocol="tcp")) as tcp_writer:
        target = owner.allocate_managed(1 << 16)
        for engine, length in ((shm_writer, 4096), (tcp_writer, 1000)):
            local = engine.allocate_managed(1 << 16)
            for _ in range(2):
                done = engine.transfer_sync([TransferRequest(OpCode.WRITE, local.addr, length,
                                                             owner.segment_name, target.addr)])
                assert done[0].ok
        mine = owner.allocate_managed(4096)
        owner.transfer_sync([TransferRequest(OpCode.READ, mine.addr, 512, owner.segment_name,
                                             target.addr)])
        assert shm_writer.traffic() == {"shm": {owner.segment_name: RouteCount(2, 8192)}}
        assert tcp_writer.traffic() == {"tcp": {owner.segment_name: RouteCount(2, 2000)}}
        assert owner.traffic() == {"local": {owner.segment_name: RouteCount(1, 512)}}
