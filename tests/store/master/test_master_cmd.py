"""`kvpool master` flag parsing: kvpool spellings and Mooncake's, with Mooncake's units and
defaults; and the process itself as Mooncake's deployment scripts start it."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from kvpool.cli.main import build_parser
from kvpool.cli.master_cmd import build_configs
from kvpool.errors import ConfigError
from tests.support.net import free_port, wait_port
from tests.support.procs import python_env, stop
from tests.support.require import skip_outside_ci


def configs(*argv: str):  # type: ignore[no-untyped-def]
    return build_configs(build_parser().parse_args(["master", *argv]))


@pytest.fixture(autouse=True)
def _no_token_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVPOOL_TOKEN", raising=False)


def test_defaults_match_mooncake() -> None:
    server, config = configs()
    assert (server.rpc_port, server.admin_port, server.metadata_port) == (50051, 9003, 8080)
    assert server.enable_http_metadata is False  # mooncake_master starts no metadata server
    assert server.host == "127.0.0.1"  # the documented difference: loopback without a token
    assert (config.lease_ttl_s, config.high_watermark, config.eviction_ratio,
            config.client_ttl_s, config.put_discard_timeout_s) == (10.0, 0.9, 0.05, 10.0, 30.0)


def test_mooncake_spellings_and_units() -> None:
    server, config = configs("--rpc_port=6000", "--metrics_port", "6001",
                             "--http_metadata_server_port", "6002",
                             "--enable_http_metadata_server=false",
                             "--default_kv_lease_ttl", "2s", "--default_kv_soft_pin_ttl", "90000",
                             "--eviction_high_watermark_ratio", "0.8", "--eviction_ratio", "0.1",
                             "--client_ttl", "3", "--put_start_discard_timeout_sec", "5",
                             "--put_start_release_timeout_sec", "60",
                             "--allocation_strategy", "free_ratio_first")
    assert (server.rpc_port, server.admin_port, server.metadata_port) == (6000, 6001, 6002)
    assert server.enable_http_metadata is False
    assert (config.lease_ttl_s, config.soft_pin_ttl_s) == (2.0, 90.0)
    assert (config.high_watermark, config.eviction_ratio, config.client_ttl_s) == (0.8, 0.1, 3.0)
    assert (config.put_discard_timeout_s, config.put_release_timeout_s) == (5.0, 60.0)
    assert config.allocation_strategy == "free_ratio_first"
    assert configs("--port", "7000", "--no-http-metadata")[0].rpc_port == 7000


@pytest.mark.parametrize("argv", [["--default_kv_lease_ttl", "soon"],
                                  ["--enable_http_metadata_server=maybe"],
                                  ["--allocation_strategy", "best"]])
def test_bad_flags_are_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        configs(*argv)


def test_metadata_server_switches() -> None:
    assert configs("--http_metadata_server_port", "6002")[0].enable_http_metadata is False
    assert configs("--enable_http_metadata_server")[0].enable_http_metadata is True
    server = configs("--metadata-port", "6003")[0]  # kvpool's spelling turns it on
    assert (server.enable_http_metadata, server.metadata_port) == (True, 6003)
    assert configs("--metadata-port", "6003", "--no-http-metadata")[0] \
        .enable_http_metadata is False


def test_mooncake_address_flags() -> None:
    assert configs("--rpc_address", "10.1.2.3")[0].host == "10.1.2.3"
    assert configs("--rpc_address=0.0.0.0", "--metrics_host=0.0.0.0",
                   "--http_metadata_server_host=0.0.0.0")[0].host == "0.0.0.0"
    assert configs("--token", "t")[0].host == "0.0.0.0"  # as mooncake_master, once guarded
    with pytest.raises(ConfigError, match="one address"):
        configs("--rpc_address", "10.1.2.3", "--metrics_host", "10.1.2.4")


def _master(*argv: str, token: str | None = None) -> subprocess.Popen[str]:
    env = python_env()
    env.pop("KVPOOL_TOKEN", None)
    if token:
        env["KVPOOL_TOKEN"] = token
    return subprocess.Popen([sys.executable, "-m", "kvpool", "master", *argv], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _first_line(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    return proc.stdout.readline()


def test_mooncake_flags_start_while_8080_is_taken() -> None:
    """Two deployments on one host: the HTTP metadata port (8080) is someone else's, and
    `--rpc_port/--metrics_port` alone must not try to open it."""
    holder = socket.socket()
    try:
        holder.bind(("127.0.0.1", 8080))
        holder.listen()
    except OSError:
        holder.close()
        skip_outside_ci("port 8080 is in use on this host; the test needs to hold it itself")
    rpc = free_port()
    proc = _master(f"--rpc_port={rpc}", f"--metrics_port={free_port()}")
    try:
        line = _first_line(proc)
        assert "no http metadata server" in line and "127.0.0.1 only" in line
        wait_port(rpc)
        assert proc.poll() is None
    finally:
        stop(proc)
        holder.close()


def _outside_address() -> str | None:
    """A non-loopback IPv4 address of this host, if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(("10.255.255.255", 1))
            address = str(sock.getsockname()[0])
        except OSError:
            return None
    return None if address.startswith("127.") else address


def test_all_interfaces_needs_a_token_and_says_so() -> None:
    refused = _master("--rpc_address=0.0.0.0", f"--rpc_port={free_port()}",
                      f"--metrics_port={free_port()}")
    _, err = refused.communicate(timeout=30)
    assert refused.returncode == 2 and "without a token" in err
    rpc = free_port()
    proc = _master(f"--rpc_port={rpc}", f"--metrics_port={free_port()}", token="s3cret")
    try:
        line = _first_line(proc)
        assert "all interfaces" in line and "token required" in line
        outside = _outside_address()
        wait_port(rpc, outside or "127.0.0.1")  # MOONCAKE_MASTER=<ip>:port from another node
    finally:
        stop(proc)


def test_kv_events_flags() -> None:
    from kvpool.kvevents.pool import PoolEventsConfig

    assert configs()[0].kv_events is None  # off by default
    server, _ = configs("--kv-events-endpoint", "tcp://10.0.0.5:5557",
                        "--kv-events-replay-endpoint", "tcp://*:5560", "--kv-events-block-size", "128")
    assert server.kv_events == PoolEventsConfig("tcp://10.0.0.5:5557", "tcp://*:5560", "kvpool-pool", 128)
    with pytest.raises(ConfigError, match="tcp://"):
        configs("--kv-events-endpoint", "10.0.0.5:5557")
