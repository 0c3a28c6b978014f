"""Master high availability through etcd: leader election, and fencing.

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
connection attempt (`wire.leader.leader_resolver`), so they follow a failover by reconnecting.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from kvpool.errors import KvpoolError
from kvpool.log import get_logger
from kvpool.store.wire.leader import Etcd, b64, leader_key

log = get_logger("store.election")


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
                   {"key": b64(self.key), "result": "EQUAL", "target": "CREATE",
                    "create_revision": 0},
                   {"key": b64(self.term_key), "result": "EQUAL", "target": "VERSION",
                    "version": version}],
               "success": [
                   {"request_put": {"key": b64(self.key), "value": b64(value),
                                    "lease": lease}},
                   {"request_put": {"key": b64(self.term_key), "value": b64(str(term))}}],
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
