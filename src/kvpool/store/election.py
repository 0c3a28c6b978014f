"""Master high availability through etcd: leader election, fencing and leader lookup.

Keys (under /kvpool/<cluster_id>/master/):

    leader   {"address": "host:port", "term": N}   attached to the leader's lease
    term     "N"                                   the last term handed out (no lease)

A master campaigns by granting itself a lease and running one transaction: if `leader` does
not exist and `term` still has the version it read (N-1), put both (`leader` on the lease).
So exactly one master wins each term, and terms only grow. The winner keeps the lease alive
every ttl/4; it believes itself leader only until `sent + ttl` of its last successful
renewal (the lease cannot expire in etcd before that: etcd starts counting later than the
request left), and serves nothing after that. If it dies, the lease expires, `leader`
vanishes, and a standby (polling every `poll_s`) wins the next term.

Clients given `etcd://h1:2379;h2:2379` as the master address read `leader` before each
connection attempt (`leader_resolver`), so they follow a failover by reconnecting.
"""

from __future__ import annotations

import base64
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import requests
from etcd3gw.client import Etcd3Client

from kvpool.errors import ConfigError, KvpoolError
from kvpool.log import get_logger

log = get_logger("store.election")
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


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _unb64(text: str) -> str:
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
        kvs = self.post("/kv/range", {"key": _b64(key)}).get("kvs") or []
        return dict(kvs[0]) if kvs else None


def leader_key(cluster_id: str) -> str:
    return f"/kvpool/{cluster_id}/master/leader"


def read_leader(etcd: Etcd, cluster_id: str = "kvpool") -> tuple[str, int] | None:
    """(address, term) of the current leader, or None."""
    kv = etcd.get(leader_key(cluster_id))
    if kv is None:
        return None
    value = json.loads(_unb64(kv["value"]))
    return str(value["address"]), int(value["term"])


class LeaderElection:
    def __init__(self, etcd: Etcd, address: str, ttl_s: int = 5, cluster_id: str = "kvpool",
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.etcd = etcd
        self.address = address
        self.ttl_s = ttl_s
        self.key = leader_key(cluster_id)
        self.term_key = f"/kvpool/{cluster_id}/master/term"
        self.clock = clock
        self.term = 0
        self._lease = 0
        self._valid_until = 0.0

    def is_leader(self) -> bool:
        """True while our lease cannot have expired in etcd."""
        return self.clock() < self._valid_until

    def try_acquire(self) -> bool:
        """One attempt to become leader (KvpoolError when etcd is unreachable)."""
        if self.etcd.get(self.key) is not None:
            return False
        kv = self.etcd.get(self.term_key)
        version = int(kv["version"]) if kv else 0
        sent = self.clock()
        grant = self.etcd.post("/lease/grant", {"TTL": self.ttl_s, "ID": 0})
        lease, ttl = int(grant["ID"]), int(grant["TTL"])
        term = version + 1
        value = json.dumps({"address": self.address, "term": term})
        txn = {"compare": [
                   {"key": _b64(self.key), "result": "EQUAL", "target": "CREATE",
                    "create_revision": 0},
                   {"key": _b64(self.term_key), "result": "EQUAL", "target": "VERSION",
                    "version": version}],
               "success": [
                   {"request_put": {"key": _b64(self.key), "value": _b64(value),
                                    "lease": lease}},
                   {"request_put": {"key": _b64(self.term_key), "value": _b64(str(term))}}],
               "failure": []}
        if not self.etcd.post("/kv/txn", txn).get("succeeded"):
            self.etcd.post("/kv/lease/revoke", {"ID": lease})
            return False
        self._lease, self.term, self._valid_until = lease, term, sent + ttl
        return True

    def campaign(self, stop: threading.Event, poll_s: float = 0.2) -> int | None:
        """Wait until elected (the term) or `stop` (None)."""
        while not stop.is_set():
            try:
                if self.try_acquire():
                    return self.term
            except KvpoolError as exc:
                log.warning("campaign: %s", exc)
            stop.wait(poll_s)
        return None

    def renew(self) -> bool:
        """Keep the lease alive; False once it is lost (expired in etcd, or unrenewable
        until our own deadline passed)."""
        sent = self.clock()
        try:
            result = self.etcd.post("/lease/keepalive", {"ID": self._lease})
            ttl = int(result.get("result", {}).get("TTL", -1))
        except (KvpoolError, ValueError, TypeError) as exc:
            log.warning("cannot renew the leader lease: %s", exc)
            return self.is_leader()
        if ttl <= 0:
            self._valid_until = 0.0
            return False
        self._valid_until = sent + ttl
        return True

    def keep(self, stop: threading.Event) -> None:
        """Renew every ttl/4 until `stop` or the lease is lost (then return)."""
        while not stop.wait(self.ttl_s / 4):
            if not self.renew():
                self._valid_until = 0.0
                return

    def resign(self) -> None:
        self._valid_until = 0.0
        try:
            self.etcd.post("/kv/lease/revoke", {"ID": self._lease})
        except KvpoolError as exc:
            log.warning("could not resign (the lease expires by itself): %s", exc)


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


def advertised(host: str, port: int) -> str:
    if host in ("0.0.0.0", "::", ""):
        host = socket.getfqdn()
    return f"{host}:{port}"


def role_metrics(election: LeaderElection) -> Iterator[Any]:
    from prometheus_client.core import GaugeMetricFamily
    role = GaugeMetricFamily("kvpool_master_role", "1 for this master's role",
                             labels=["role"])
    leading = election.is_leader()
    role.add_metric(["leader"], 1.0 if leading else 0.0)
    role.add_metric(["standby"], 0.0 if leading else 1.0)
    term = GaugeMetricFamily("kvpool_master_term", "leadership term held (0: none)")
    term.add_metric([], float(election.term if leading else 0))
    yield role
    yield term
