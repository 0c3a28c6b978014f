"""The worker's counters in the Prometheus text format (GET /metrics): how its KV pool reads
went. Read at scrape time from the objects that count (the connector, the store client);
no registry, nothing kept here.

    kvpool_worker_pool_damaged_reads_total     pool reads whose bytes failed their checksum
    kvpool_worker_pool_damaged_dropped_total   of those, replicas the master dropped
    kvpool_worker_pool_recomputed_total        requests whose pool KV was damaged and which
                                               computed it instead of failing
"""

from __future__ import annotations

from typing import Protocol

from kvpool.engine.worker.pool import PoolConnector
from kvpool.store.client.types import ClientStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Counted(Protocol):
    """What is read of the worker's store: its client counters (StoreClient has them)."""

    @property
    def stats(self) -> ClientStats: ...


def counters(connector: PoolConnector, store: Counted | None) -> dict[str, tuple[str, int]]:
    """name -> (help, value); `store` is the worker's StoreClient or None (no pool)."""
    stats = store.stats if store is not None else None
    return {
        "kvpool_worker_pool_damaged_reads_total": (
            "pool reads whose bytes failed their checksum",
            stats.checksum_mismatches if stats else 0),
        "kvpool_worker_pool_damaged_dropped_total": (
            "damaged replicas the master dropped on this worker's report",
            stats.damaged_dropped if stats else 0),
        "kvpool_worker_pool_recomputed_total": (
            "requests whose KV in the pool was damaged, computed here instead",
            connector.num_recomputed),
    }


def render(values: dict[str, tuple[str, int]]) -> str:
    lines = []
    for name, (text, value) in values.items():
        lines += [f"# HELP {name} {text}", f"# TYPE {name} counter", f"{name} {value}"]
    return "\n".join(lines) + "\n"
