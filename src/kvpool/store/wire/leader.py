"""The master's leader record in etcd, shared by masters and clients: where it lives, how
to read it, and how a client turns an `etcd://h1:2379;h2:2379[/cluster_id]` master address
into the current leader's address.

Keys (under /kvpool/<cluster_id>/master/):

    leader   {"address": "host:port", "term": N}   attached to the leader's lease
    term     "N"                                   the last term handed out (no lease)

The election itself (campaign, renewal, fencing) is the master's: store/master/election.py.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Sequence
from typing import Any

import requests
from etcd3gw.client import Etcd3Client

from kvpool.errors import ConfigError, KvpoolError
from kvpool.log import get_logger

log = get_logger("store.leader")
API_PATH = "/v3/"
DEFAULT_ETCD_PORT = 2379


def parse_endpoints(text: str) -> list[tuple[str, int]]:
    """[(host, port)] from 'etcd://h1:2379;h2:2379', 'h1:2379,h2' (Mooncake uses ';')."""
    body = text.split("://", 1)[1] if "://" in text else text
    out = []
    for item in body.replace(";", ",").split(","):
        item = item.strip().rstrip("/")
        if not item:
            continue
        host, sep, port = item.rpartition(":")
        if not sep:
            host, port = item, str(DEFAULT_ETCD_PORT)
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"bad etcd endpoint {item!r} in {text!r}: use host:port")
        out.append((host, int(port)))
    if not out:
        raise ConfigError(f"no etcd endpoint in {text!r}")
    return out


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def unb64(text: str) -> str:
    return base64.b64decode(text).decode()


class Etcd:
    """The few etcd v3 calls the election needs, over its JSON gateway, trying each
    endpoint in turn (the last one that answered first)."""

    def __init__(self, endpoints: Sequence[tuple[str, int]], timeout_s: float = 2.0) -> None:
        self._clients = []
        for host, port in endpoints:
            session = requests.Session()
            session.trust_env = False
            self._clients.append(Etcd3Client(host=host, port=port, timeout=timeout_s,
                                             api_path=API_PATH, session=session))
        self._first = 0

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """KvpoolError when no endpoint answers."""
        errors = []
        for i in range(len(self._clients)):
            index = (self._first + i) % len(self._clients)
            client = self._clients[index]
            try:
                result = client.post(client.get_url(path), json=body)
            except Exception as exc:  # noqa: BLE001 - etcd3gw raises many kinds
                errors.append(f"{client.host}:{client.port}: {exc}")
                continue
            self._first = index
            return dict(result)
        raise KvpoolError(f"etcd unreachable for {path}: {'; '.join(errors)}")

    def get(self, key: str) -> dict[str, Any] | None:
        kvs = self.post("/kv/range", {"key": b64(key)}).get("kvs") or []
        return dict(kvs[0]) if kvs else None


def leader_key(cluster_id: str) -> str:
    return f"/kvpool/{cluster_id}/master/leader"


def read_leader(etcd: Etcd, cluster_id: str = "kvpool") -> tuple[str, int] | None:
    """(address, term) of the current leader, or None."""
    kv = etcd.get(leader_key(cluster_id))
    if kv is None:
        return None
    value = json.loads(unb64(kv["value"]))
    return str(value["address"]), int(value["term"])


def leader_resolver(address: str) -> Callable[[], tuple[str, int] | None] | None:
    """For an 'etcd://h1:2379;h2:2379[/cluster_id]' master address, a function giving the
    leader's (host, port) (None while there is none); None for a plain HOST:PORT."""
    if not address.startswith("etcd://"):
        return None
    endpoints, _, cluster_id = address[len("etcd://"):].partition("/")
    etcd = Etcd(parse_endpoints(endpoints))
    cluster_id = cluster_id.strip("/") or "kvpool"

    def resolve() -> tuple[str, int] | None:
        try:
            found = read_leader(etcd, cluster_id)
        except (KvpoolError, ValueError, KeyError) as exc:
            log.debug("no leader from %s: %s", address, exc)
            return None
        if found is None:
            return None
        host, _, port = found[0].rpartition(":")
        return host, int(port)

    return resolve
