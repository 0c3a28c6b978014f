"""`connect_metadata(uri)`: turn a metadata URI into a backend (or None for P2P handshake)."""

from __future__ import annotations

import re
from urllib.parse import urlsplit

from kvpool.errors import ConfigError
from kvpool.metadata.base import DEFAULT_TIMEOUT_S, MetadataBackend, MetadataClientConfig

P2P_HANDSHAKE = "P2PHANDSHAKE"
DEFAULT_ETCD_PORT = 2379
ACCEPTED_FORMS = (
    "'P2PHANDSHAKE' (no directory), 'http://host:port/metadata', "
    "'etcd://host:port[,host:port...]', or a bare etcd 'host:port'"
)
_HOST_PORT = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.-]+)(?::(\d+))?$")


def connect_metadata(uri: str, timeout_s: float = DEFAULT_TIMEOUT_S,
                     token: str | None = None) -> MetadataBackend | None:
    """The backend that `uri` names; None for P2PHANDSHAKE (peers are asked directly).
    `token` authenticates writes to an HTTP server (None: $KVPOOL_TOKEN, if set; "": none).

    Connecting is lazy: an unreachable service shows up as MetadataError on the first call,
    not here. Raises ConfigError for a URI of no accepted form.
    """
    config = (MetadataClientConfig(timeout_s=timeout_s) if token is None
              else MetadataClientConfig(timeout_s=timeout_s, token=token))
    text = uri.strip() if isinstance(uri, str) else ""
    if text.upper() == P2P_HANDSHAKE:
        return None
    scheme = text.split("://", 1)[0].lower() if "://" in text else ""
    if scheme in ("http", "https"):
        from kvpool.metadata.http_client import HttpMetadataBackend

        return HttpMetadataBackend(check_http_url(text), config)
    if scheme == "etcd" or (not scheme and _is_host_port(text, require_port=True)):
        from kvpool.metadata.etcd_backend import EtcdMetadataBackend

        return EtcdMetadataBackend(parse_etcd_endpoints(text), config)
    if scheme == "redis":
        raise ConfigError(f"redis metadata ({uri!r}) is not supported by kvpool: use {ACCEPTED_FORMS}")
    raise ConfigError(f"unsupported metadata URI {uri!r}: use {ACCEPTED_FORMS}")


def check_http_url(url: str) -> str:
    """`url` itself if it names a host and a path (the server answers on one path only)."""
    parts = urlsplit(url)
    if not parts.hostname:
        raise ConfigError(f"metadata URL {url!r} has no host: use http://host:port/metadata")
    try:
        _ = parts.port
    except ValueError as exc:
        raise ConfigError(f"metadata URL {url!r} has a bad port: {exc}") from exc
    if parts.path in ("", "/"):
        raise ConfigError(
            f"metadata URL {url!r} has no path: use http://{parts.netloc}/metadata"
        )
    if parts.query or parts.fragment:
        raise ConfigError(f"metadata URL {url!r} must not carry a query or fragment")
    return url


def parse_etcd_endpoints(uri: str) -> list[tuple[str, int]]:
    """[(host, port), ...] from 'etcd://h1:p1,h2:p2' or 'h:p' (port defaults to 2379)."""
    body = uri.split("://", 1)[1] if "://" in uri else uri
    body = body.rstrip("/")
    endpoints = []
    for item in body.split(","):
        match = _HOST_PORT.match(item.strip())
        if match is None:
            raise ConfigError(f"bad etcd endpoint {item!r} in {uri!r}: use host:port")
        host = match.group(1).strip("[]")
        port = int(match.group(2)) if match.group(2) else DEFAULT_ETCD_PORT
        if not 1 <= port <= 65535:
            raise ConfigError(f"etcd port {port} in {uri!r} is not in 1..65535")
        endpoints.append((host, port))
    return endpoints


def _is_host_port(text: str, require_port: bool) -> bool:
    match = _HOST_PORT.match(text)
    return match is not None and (match.group(2) is not None or not require_port)
