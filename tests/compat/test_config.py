"""Mooncake configuration forms: setup positional/keyword/dict, JSON file, MOONCAKE_* env."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpool.compat.mooncake.config import (
    DEFAULT_GLOBAL_SEGMENT_SIZE,
    MooncakeConfig,
    from_env,
    from_mapping,
    from_setup_args,
    split_hostname,
)
from kvpool.compat.mooncake.store import MooncakeDistributedStore
from kvpool.errors import ConfigError
from tests.compat.conftest import Master

BASE = {"local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE"}


def test_dict_accepts_both_master_spellings_and_size_strings() -> None:
    a = from_mapping({**BASE, "master_server_addr": "h:1", "global_segment_size": "16MB",
                      "local_buffer_size": "4gb", "rdma_devices": "mlx5_0"})
    b = from_mapping({**BASE, "master_server_address": "h:1", "global_segment_size": 16 << 20,
                      "local_buffer_size": str(4 << 30), "device_name": "mlx5_0"})
    assert a == b
    assert (a.global_segment_size, a.local_buffer_size, a.device_name) == (16 << 20, 4 << 30,
                                                                          "mlx5_0")
    assert from_mapping({**BASE, "master_server_addr": "h:1"}).global_segment_size == 16 << 20


@pytest.mark.parametrize("body", [
    {**BASE, "master_server_addr": "h:1", "global_segment_size": "50%"},
    {**BASE, "master_server_addr": "h:1", "local_buffer_size": -1},
    {**BASE},
    {"metadata_server": "P2PHANDSHAKE", "master_server_addr": "h:1"},
    {**BASE, "master_server_addr": "no-port"},
    {**BASE, "master_server_addr": "h:1", "enable_ssd_offload": "maybe"},
])
def test_bad_dicts_are_refused(body: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        from_mapping(body)


def test_positional_and_keyword_forms_bind_like_mooncake() -> None:
    cfg, engine = from_setup_args(("h", "P2PHANDSHAKE", "1MB", 2048, "tcp", "", "m:2"), {})
    assert (cfg.local_hostname, cfg.global_segment_size, cfg.local_buffer_size) == ("h", 1 << 20,
                                                                                  2048)
    assert (cfg.master_server_address, engine) == ("m:2", None)
    cfg2, engine2 = from_setup_args(("h", "P2PHANDSHAKE"), {
        "global_segment_size": 1 << 20, "local_buffer_size": 2048, "protocol": "tcp",
        "rdma_devices": "", "master_server_addr": "m:2", "engine": "E"})
    assert cfg2 == cfg and engine2 == "E"
    with pytest.raises(TypeError):
        from_setup_args(("h", "P2PHANDSHAKE", 1, 2, "tcp", ""), {"master_server_address": "m:2"})
    with pytest.raises(TypeError):
        from_setup_args(("h",), {})


def test_json_file_and_environment(tmp_path: Path) -> None:
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps({"local_hostname": "10.0.0.1", "metadata_server":
                                "etcd://10.0.0.2:2379", "global_segment_size": "1GB",
                                "local_buffer_size": 1 << 20, "protocol": "rdma",
                                "device_name": "", "master_server_address": "10.0.0.2:50051"}))
    from_file = MooncakeConfig.from_file(str(path))
    assert (from_file.global_segment_size, from_file.metadata_server) == (1 << 30,
                                                                          "etcd://10.0.0.2:2379")
    assert from_env({"MOONCAKE_CONFIG_PATH": str(path), "MOONCAKE_MASTER": "x:1"}) == from_file
    env = from_env({"MOONCAKE_MASTER": "m:50051", "MOONCAKE_GLOBAL_SEGMENT_SIZE": "4gb"})
    assert (env.local_hostname, env.metadata_server, env.protocol) == ("localhost",
                                                                       "P2PHANDSHAKE", "tcp")
    assert (env.global_segment_size, env.local_buffer_size) == (4 << 30, 1 << 30)
    assert from_env({"MOONCAKE_MASTER": "m:1"}).global_segment_size == DEFAULT_GLOBAL_SEGMENT_SIZE
    with pytest.raises(ConfigError):
        from_env({})
    path.write_text("[1, 2]")
    with pytest.raises(ConfigError):
        MooncakeConfig.from_file(str(path))
    with pytest.raises(ConfigError):
        MooncakeConfig.from_file(str(tmp_path / "missing.json"))


def test_client_config_mapping() -> None:
    cfg = from_mapping({**BASE, "local_hostname": "127.0.0.1:13000", "master_server_addr": "m:1",
                        "protocol": "rdma"})
    client = cfg.client_config()
    assert (client.local_hostname, client.te_port, client.protocol) == ("127.0.0.1", 13000, "auto")
    picked = from_mapping({**BASE, "master_server_addr": "m:1"}).client_config().te_port
    assert 12300 <= picked <= 14300
    assert split_hostname("[::1]:80") == ("::1", 80)
    assert split_hostname("host") == ("host", 0)


def test_setup_forms_against_a_master(master: Master, tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    forms: list[tuple[tuple[object, ...], dict[str, object]]] = [
        (("127.0.0.1", master.http_metadata, "8MB", "4MB", "tcp", "", master.address), {}),
        (({**BASE, "master_server_address": master.address, "global_segment_size": "8MB"},), {}),
        ((), {"local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE",
              "global_segment_size": 8 << 20, "local_buffer_size": 1 << 20, "protocol": "tcp",
              "rdma_devices": "", "master_server_addr": master.address}),
    ]
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps({**BASE, "master_server_address": master.address,
                                "global_segment_size": "8MB", "local_buffer_size": "1MB",
                                "protocol": "tcp", "device_name": ""}))
    monkeypatch.setenv("MOONCAKE_CONFIG_PATH", str(path))
    forms.append(((), {}))
    for args, kwargs in forms:
        store = MooncakeDistributedStore()
        assert store.setup(*args, **kwargs) == 0, (args, kwargs)
        assert store.put("cfg-key", b"v") == 0 and store.get("cfg-key") == b"v"
        assert store.remove("cfg-key", force=True) == 0
        assert store.close() == 0


def test_setup_failures_return_minus_one(master: Master) -> None:
    store = MooncakeDistributedStore()
    assert store.setup({**BASE, "master_server_addr": master.address,
                        "global_segment_size": "50%"}) == -1
    assert store.setup("127.0.0.1", "redis://127.0.0.1:1", 0, 0, "tcp", "", master.address) == -1
    with pytest.raises(TypeError):
        store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 0, "tcp", "", master.address, bogus=1)
    assert store.health_check() == 1
