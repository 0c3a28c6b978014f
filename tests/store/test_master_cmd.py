"""`kvpool master` flag parsing: kvpool spellings and Mooncake's, with Mooncake's units."""

from __future__ import annotations

import pytest

from kvpool.cli.main import build_parser
from kvpool.cli.master_cmd import build_configs


def configs(*argv: str):  # type: ignore[no-untyped-def]
    return build_configs(build_parser().parse_args(["master", *argv]))


def test_defaults_match_mooncake() -> None:
    server, config = configs()
    assert (server.rpc_port, server.admin_port, server.metadata_port) == (50051, 9003, 8080)
    assert server.enable_http_metadata is True
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
