"""`--token` and `--insecure` on every serving command: a token reaches every part of a
cluster, and without one nothing binds beyond loopback unless told to."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import httpx
import pytest

from kvpool.cli.main import build_parser
from kvpool.cli.master_cmd import build_configs
from kvpool.cli.security import bind_refusal, is_loopback, token_file
from tests.support.net import free_port, wait_port
from tests.support.procs import python_env, running, spawn_kvpool
from tests.support.wait import wait_for

TOKEN = "cli-secret"


def _run(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvpool", *argv], capture_output=True,
                          text=True, timeout=60, env=env or python_env())


@pytest.mark.parametrize("argv", [["master", "--no-http-metadata"], ["metadata"],
                                  ["store-node", "--dram", "1MiB"], ["up", "--no-token"],
                                  ["up", "--store-only"]])
def test_no_token_refuses_a_public_address(argv: list[str]) -> None:
    env = python_env()
    env.pop("KVPOOL_TOKEN", None)
    out = _run(*argv, "--host", "0.0.0.0", env=env)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr
    assert "refusing to listen on 0.0.0.0 without a token" in lines[0]
    assert "--token" in lines[0] and "--insecure" in lines[0]


def test_bind_rule() -> None:
    for host in ("127.0.0.1", "127.0.0.2", "localhost", "::1"):
        assert is_loopback(host) and bind_refusal("x", host, None, False) is None
    for host in ("0.0.0.0", "10.0.0.1", "example.org", "::"):
        assert not is_loopback(host)
        assert bind_refusal("x", host, None, False) is not None
        assert bind_refusal("x", host, "t", False) is None
        assert bind_refusal("x", host, None, True) is None


def test_token_flag_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVPOOL_TOKEN", raising=False)
    assert build_configs(build_parser().parse_args(["master"]))[0].token is None
    args = build_parser().parse_args(["master", "--token", TOKEN])
    assert build_configs(args)[0].token == TOKEN
    monkeypatch.setenv("KVPOOL_TOKEN", "from-env")
    assert build_configs(build_parser().parse_args(["master"]))[0].token == "from-env"
    for command in (["metadata"], ["store-node", "--dram", "1MiB"], ["up"]):
        assert build_parser().parse_args(command).token == "from-env"


def test_store_node_with_a_token_joins_a_guarded_master() -> None:
    rpc, admin, meta = free_port(), free_port(), free_port()
    env_free = python_env()
    env_free.pop("KVPOOL_TOKEN", None)
    master = spawn_kvpool("master", "--rpc-port", str(rpc), "--admin-port", str(admin),
                          "--metadata-port", str(meta), "--token", TOKEN)
    with running(master):
        wait_port(rpc), wait_port(admin), wait_port(meta)
        node = spawn_kvpool("store-node", "--dram", "4MiB", "--master", f"127.0.0.1:{rpc}",
                            "--metadata", f"http://127.0.0.1:{meta}/metadata",
                            "--token", TOKEN)
        with running(node):
            headers = {"authorization": f"Bearer {TOKEN}"}
            segments: list[dict[str, object]] = wait_for(
                lambda: httpx.get(f"http://127.0.0.1:{admin}/segments", headers=headers).json(),
                30.0, "the node to mount", 0.1, procs=[node])
            assert [s["capacity_bytes"] for s in segments] == [4 << 20]
            endpoint = segments[0]["endpoint"]
            descriptor = httpx.get(f"http://127.0.0.1:{meta}/metadata",
                                   params={"key": f"kvpool/segments/{endpoint}"})
            assert descriptor.status_code == 200   # published with the token
        assert node.returncode == 0


def test_up_demo_with_a_token() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvpool", "up", "--store-only", "--demo", "--no-bench", "--dram", "64MiB",
         "--token", TOKEN], capture_output=True, text=True, timeout=180, env=python_env())
    assert out.returncode == 0, out.stdout + out.stderr
    assert "demo: all checks passed" in out.stdout


def test_clusters_on_two_addresses_and_one_port_keep_their_own_token_files(
        monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> None:
    """A second `kvpool up --host 127.0.0.2 --port P` beside one on 127.0.0.1:P (the port
    check is per address) neither rewrites nor deletes the first one's token file."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert token_file(8000) == tmp_path / "kvpool" / "up-8000.token"
    assert token_file(8000, "127.0.0.2") == tmp_path / "kvpool" / "up-127.0.0.2-8000.token"
    assert token_file(8000, "::1").name == "up-__1-8000.token"
