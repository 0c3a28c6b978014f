"""The store-node daemon: a client that only contributes memory to the pool."""

from __future__ import annotations

import threading

from kvpool.log import get_logger
from kvpool.store.client import StoreClient
from kvpool.store.client_config import ClientConfig

log = get_logger("store.node")


def run_store_node(config: ClientConfig, stop: threading.Event) -> None:
    """Mount `config.global_segment_size` bytes and heartbeat until `stop` is set; then
    unmount cleanly (the master drops the objects held here)."""
    with StoreClient(config) as client:
        log.info("store node %s contributes %d bytes as %s", client.endpoint,
                 config.global_segment_size, ", ".join(client.segment_ids))
        print(f"kvpool store-node ready: {client.endpoint} "
              f"{' '.join(client.segment_ids)}", flush=True)
        stop.wait()
