"""`kvpool mooncake activate|deactivate`: the shim package, its refusals, and a script written
for Mooncake running unchanged on kvpool in a fresh process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from kvpool.compat import activate as shim
from tests.compat.conftest import Master
from tests.compat.script_runner import MOONCAKE_RESULTS, run_script
from tests.support.net import free_port, wait_port
from tests.support.procs import python_env, running
from tests.support.require import missing


def kvpool_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvpool", *args], env=python_env(),
                          capture_output=True, text=True, timeout=60)


def test_activate_then_deactivate(tmp_path: Path) -> None:
    (tmp_path / "other_package").mkdir()
    done = kvpool_cli("mooncake", "activate", "--target", str(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(p.name for p in (tmp_path / "mooncake").iterdir()) == [
        "KVPOOL_MOONCAKE_SHIM", "__init__.py", "engine.py", "mooncake_config.py", "store.py"]
    assert shim.status(tmp_path).shim_active
    assert shim.activate(tmp_path)[0]  # idempotent
    probe = subprocess.run(
        [sys.executable, "-c", "import mooncake.store as s, mooncake.engine as e, "
         "mooncake.mooncake_config as c; print(s.MooncakeDistributedStore.__module__, "
         "e.TransferEngine.__module__, c.MooncakeConfig.__module__, int(s.COMPLETE))"],
        env={**python_env(), "PYTHONPATH": f"{tmp_path}:{python_env()['PYTHONPATH']}"},
        capture_output=True, text=True, timeout=60)
    assert probe.stdout.split() == ["kvpool.compat.mooncake.store",
                                    "kvpool.compat.mooncake.engine",
                                    "kvpool.compat.mooncake.config", "3"], probe.stderr
    assert kvpool_cli("mooncake", "deactivate", "--target", str(tmp_path)).returncode == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other_package"]
    done_again, message = shim.deactivate(tmp_path)
    assert done_again and "nothing to do" in message


def test_refuses_to_shadow_the_real_wheel(tmp_path: Path) -> None:
    (tmp_path / "mooncake_transfer_engine_non_cuda-0.3.13.post1.dist-info").mkdir()
    refused = kvpool_cli("mooncake", "activate", "--target", str(tmp_path))
    assert refused.returncode == 1 and "real Mooncake is installed" in refused.stdout
    assert not (tmp_path / "mooncake").exists()
    status = kvpool_cli("mooncake", "status", "--target", str(tmp_path)).stdout
    assert "shim active: no" in status and "0.3.13.post1.dist-info" in status


def test_never_touches_a_foreign_mooncake_package(tmp_path: Path) -> None:
    (tmp_path / "mooncake").mkdir()
    (tmp_path / "mooncake" / "__init__.py").write_text("# someone else's\n")
    assert shim.activate(tmp_path)[0] is False
    assert shim.deactivate(tmp_path)[0] is False
    assert (tmp_path / "mooncake" / "__init__.py").read_text() == "# someone else's\n"
    assert shim.activate(tmp_path / "missing")[0] is False


def test_detects_the_wheel_installed_in_this_environment() -> None:
    found = shim.find_real_mooncake(shim.default_target())
    if not found:
        missing("the real Mooncake wheel is not installed here")
    assert shim.status(shim.default_target()).foreign_package  # its package, not ours


def test_mooncake_script_runs_unchanged(master: Master, tmp_path: Path) -> None:
    assert shim.activate(tmp_path)[0]
    results = run_script(master.address, tmp_path)
    assert results.pop("implementation") == "kvpool"
    assert results == MOONCAKE_RESULTS


def test_mooncake_deployment_runs_unchanged(tmp_path: Path) -> None:
    """`mooncake_master` with Mooncake's flags, then the client script with HTTP metadata."""
    site, bin_dir = tmp_path / "site", tmp_path / "bin"
    site.mkdir(), bin_dir.mkdir()
    done = kvpool_cli("mooncake", "activate", "--target", str(site), "--scripts", str(bin_dir))
    assert done.returncode == 0, done.stdout + done.stderr
    rpc, meta = free_port(), free_port()
    master = subprocess.Popen(
        [str(bin_dir / "mooncake_master"), f"--rpc_port={rpc}", f"--metrics_port={free_port()}",
         "--enable_http_metadata_server=true", f"--http_metadata_server_port={meta}",
         "--default_kv_lease_ttl=5000"], env=python_env())
    with running(master):
        wait_port(rpc), wait_port(meta)
        results = run_script(f"127.0.0.1:{rpc}", site, f"http://127.0.0.1:{meta}/metadata")
    assert results.pop("implementation") == "kvpool"
    assert results == MOONCAKE_RESULTS
    assert shim.deactivate(site, bin_dir)[0]
    assert list(bin_dir.iterdir()) == [] and list(site.iterdir()) == []


def test_master_script_never_overwrites_a_foreign_one(tmp_path: Path) -> None:
    (tmp_path / "mooncake_master").write_text("#!/bin/sh\necho real\n")
    done, message = shim.activate(tmp_path, tmp_path)
    assert not done and "not kvpool's" in message
    assert not (tmp_path / "mooncake").exists()
    assert shim.deactivate(tmp_path, tmp_path)[0]
    assert (tmp_path / "mooncake_master").read_text() == "#!/bin/sh\necho real\n"
