"""Mooncake's configuration, read the ways its users write it: `setup(...)` positional and
keyword forms, `setup(dict)`, a `MOONCAKE_CONFIG_PATH` JSON file, `MOONCAKE_*` variables.

More forgiving than Mooncake where its users trip: the master may be spelled
`master_server_addr` or `master_server_address`, the device `rdma_devices` or `device_name`;
sizes may be ints, digit strings or "16MB"/"4gb". Everything ends in one frozen
`MooncakeConfig`, whose `client_config()` is the kvpool store client's config.
"""

from __future__ import annotations

import inspect
import json
import os
import random
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvpool.errors import ConfigError
from kvpool.store.client.config import ClientConfig
from kvpool.units import parse_size

DEFAULT_GLOBAL_SEGMENT_SIZE = 3355443200
"""Environment-variable default of `MOONCAKE_GLOBAL_SEGMENT_SIZE` (3.125 GiB)."""
DEFAULT_LOCAL_BUFFER_SIZE = 1 << 30
"""Environment-variable default of `MOONCAKE_LOCAL_BUFFER_SIZE`."""
DICT_DEFAULT_SIZE = 16 << 20
"""`setup(dict)` default of both sizes, as in Mooncake."""
PORT_RANGE = (12300, 14300)
"""A `local_hostname` without a port gets a free port from this range."""
_PROTOCOLS = {"tcp": "tcp", "shm": "shm", "auto": "auto"}
"""Mooncake protocol -> kvpool transport; others (rdma, nvlink, ...) fall back to auto."""


@dataclass(frozen=True)
class MooncakeConfig:
    local_hostname: str
    """"host" or "host:port" of this process's transfer engine."""
    metadata_server: str
    """P2PHANDSHAKE, http://h:p/metadata, etcd://h:p or a bare etcd h:p."""
    global_segment_size: int
    """Bytes this process contributes to the pool (0 = pure client)."""
    local_buffer_size: int
    """Staging buffer of the bytes API (0 makes `put` of bytes fail)."""
    protocol: str
    device_name: str
    master_server_address: str
    enable_ssd_offload: bool = False
    ssd_offload_path: str = ""
    tenant_id: str = "default"
    enable_client_http_server: bool = False
    client_http_port: int = 9300

    def __post_init__(self) -> None:
        if not self.local_hostname:
            raise ConfigError("local_hostname is required (e.g. '127.0.0.1')")
        if not self.metadata_server:
            raise ConfigError("metadata_server is required (e.g. 'P2PHANDSHAKE')")
        if not self.master_server_address or ":" not in self.master_server_address:
            raise ConfigError("master_server_addr must be HOST:PORT, got "
                              f"{self.master_server_address!r}")
        if self.global_segment_size < 0 or self.local_buffer_size < 0:
            raise ConfigError("segment and buffer sizes must be >= 0")

    @staticmethod
    def from_file(file_path: str) -> MooncakeConfig:
        """Read a Mooncake JSON config file."""
        try:
            with open(file_path, encoding="utf-8") as f:
                body = json.load(f)
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"cannot read Mooncake config {file_path!r}: {exc}") from exc
        if not isinstance(body, dict):
            raise ConfigError(f"Mooncake config {file_path!r} must hold a JSON object")
        return from_mapping(body, DEFAULT_GLOBAL_SEGMENT_SIZE, DEFAULT_LOCAL_BUFFER_SIZE)

    @staticmethod
    def load_from_env() -> MooncakeConfig:
        """`MOONCAKE_CONFIG_PATH` if set, else the `MOONCAKE_*` variables."""
        return from_env(os.environ)

    def client_config(self) -> ClientConfig:
        host, port = split_hostname(self.local_hostname)
        protocol = _PROTOCOLS.get(self.protocol.lower(), "auto")
        return ClientConfig(master=self.master_server_address, local_hostname=host,
                            te_port=port or pick_port(host), metadata=self.metadata_server,
                            protocol=protocol, global_segment_size=self.global_segment_size,
                            local_buffer_size=self.local_buffer_size)


def _first(body: Mapping[str, Any], *names: str, default: Any = None) -> Any:
    for name in names:
        value = body.get(name)
        if value is not None and value != "":
            return value
    return default


def parse_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", ""):
        return False
    raise ConfigError(f"expected a boolean, got {value!r}")


def from_mapping(body: Mapping[str, Any], default_segment: int = DICT_DEFAULT_SIZE,
                 default_buffer: int = DICT_DEFAULT_SIZE) -> MooncakeConfig:
    """A config from a dict of Mooncake keys (either spelling of master and device)."""
    return MooncakeConfig(
        local_hostname=str(_first(body, "local_hostname", default="")),
        metadata_server=str(_first(body, "metadata_server", default="")),
        global_segment_size=parse_size(_first(body, "global_segment_size",
                                              default=default_segment)),
        local_buffer_size=parse_size(_first(body, "local_buffer_size", default=default_buffer)),
        protocol=str(_first(body, "protocol", default="tcp")),
        device_name=str(_first(body, "device_name", "rdma_devices", default="")),
        master_server_address=str(_first(body, "master_server_addr", "master_server_address",
                                         default="")),
        enable_ssd_offload=parse_bool(body.get("enable_ssd_offload", False)),
        ssd_offload_path=str(body.get("ssd_offload_path", "") or ""),
        tenant_id=str(body.get("tenant_id", "default") or "default"),
        enable_client_http_server=parse_bool(body.get("enable_client_http_server", False)),
        client_http_port=int(body.get("client_http_port", 9300)))


def from_env(env: Mapping[str, str]) -> MooncakeConfig:
    path = env.get("MOONCAKE_CONFIG_PATH")
    if path:
        return MooncakeConfig.from_file(path)
    if not env.get("MOONCAKE_MASTER"):
        raise ConfigError("neither MOONCAKE_CONFIG_PATH nor MOONCAKE_MASTER is set")
    return from_mapping({
        "local_hostname": env.get("MOONCAKE_LOCAL_HOSTNAME", "localhost"),
        "metadata_server": env.get("MOONCAKE_TE_META_DATA_SERVER", "P2PHANDSHAKE"),
        "global_segment_size": env.get("MOONCAKE_GLOBAL_SEGMENT_SIZE",
                                       DEFAULT_GLOBAL_SEGMENT_SIZE),
        "local_buffer_size": env.get("MOONCAKE_LOCAL_BUFFER_SIZE", DEFAULT_LOCAL_BUFFER_SIZE),
        "protocol": env.get("MOONCAKE_PROTOCOL", "tcp"),
        "device_name": env.get("MOONCAKE_DEVICE", ""),
        "master_server_address": env["MOONCAKE_MASTER"],
        "enable_ssd_offload": env.get("MOONCAKE_OFFLOAD_ENABLED", "false"),
        "ssd_offload_path": env.get("MOONCAKE_OFFLOAD_FILE_STORAGE_PATH", ""),
        "tenant_id": env.get("MOONCAKE_TENANT_ID", "default"),
        "enable_client_http_server": env.get("MOONCAKE_ENABLE_CLIENT_HTTP_SERVER", "false"),
        "client_http_port": env.get("MOONCAKE_CLIENT_HTTP_PORT", "9300"),
    })


def _positional_setup(local_hostname: str, metadata_server: str, global_segment_size: Any,
                      local_buffer_size: Any, protocol: str, rdma_devices: str,
                      master_server_addr: str, engine: Any = None,
                      enable_ssd_offload: bool = False, ssd_offload_path: str = "",
                      tenant_id: str = "default", enable_client_http_server: bool = False,
                      client_http_port: int = 9300) -> None:
    """Mooncake's `setup` signature; only used to bind arguments (names and defaults)."""


SETUP_SIGNATURE = inspect.signature(_positional_setup)


def from_setup_args(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[MooncakeConfig, Any]:
    """(config, engine) from `setup`'s arguments. Raises TypeError for unknown or missing
    arguments (as Mooncake does) and ConfigError for bad values."""
    if len(args) == 1 and not kwargs and isinstance(args[0], Mapping):
        return from_mapping(args[0]), args[0].get("engine")
    if not args and set(kwargs) == {"config"} and isinstance(kwargs["config"], Mapping):
        return from_mapping(kwargs["config"]), None
    bound = SETUP_SIGNATURE.bind(*args, **kwargs)
    bound.apply_defaults()
    values = dict(bound.arguments)
    engine = values.pop("engine")
    values["master_server_address"] = values.pop("master_server_addr")
    return from_mapping(values), engine


def split_hostname(text: str) -> tuple[str, int]:
    """("host", port or 0) from "host", "host:port" or "[v6]:port"."""
    host, sep, port = text.rpartition(":")
    if sep and port.isdigit() and host and (host.count(":") == 0 or host.endswith("]")):
        return host.strip("[]"), int(port)
    return text.strip("[]"), 0


def pick_port(host: str, tries: int = 64) -> int:
    """A port in PORT_RANGE free on `host` a moment ago (0 = let the OS pick)."""
    bind_host = "127.0.0.1" if host in ("localhost", "") else host
    for _ in range(tries):
        port = random.randint(*PORT_RANGE)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((bind_host, port))
            except OSError:
                continue
            return port
    return 0
