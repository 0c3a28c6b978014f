"""The store-node daemon: a client that only contributes memory to the pool."""

from __future__ import annotations

import threading

from kvpool.errors import MetadataError, RpcError
from kvpool.launch.ready import announce_ready
from kvpool.log import get_logger
from kvpool.store.client.config import ClientConfig
from kvpool.store.client.store_client import StoreClient
from kvpool.store.node.ssd_worker import SsdConfig, SsdWorker

log = get_logger("store.node")


def _connect(config: ClientConfig, stop: threading.Event,
             retry_s: float) -> StoreClient | None:
    """A client with its segment mounted; waits for an unreachable master (or segment
    directory, often the master's) until `stop`."""
    while not stop.is_set():
        try:
            return StoreClient(config)
        except (RpcError, MetadataError) as exc:
            log.warning("cannot mount at master %s yet (%s); retrying in %.0fs",
                        config.master, exc, retry_s)
            stop.wait(retry_s)
    return None


def run_store_node(config: ClientConfig, stop: threading.Event,
                   retry_s: float = 2.0, ssd: SsdConfig | None = None) -> None:
    """Mount `config.global_segment_size` bytes (and the disk tier `ssd`) and heartbeat
    until `stop` is set; then unmount cleanly (the master drops the objects held here; the
    files stay, and are registered again at the next start)."""
    client = _connect(config, stop, retry_s)
    if client is None:
        return
    with client:
        worker = SsdWorker(client, ssd) if ssd is not None else None
        thread = threading.Thread(target=worker.run, args=(stop,), daemon=True,
                                  name="kvpool-ssd") if worker is not None else None
        if thread is not None:
            thread.start()
        log.info("store node %s contributes %d bytes as %s", client.endpoint,
                 config.global_segment_size, ", ".join(client.segment_ids))
        announce_ready(f"kvpool store-node ready: {client.endpoint} "
                       f"{' '.join(client.segment_ids)}")
        stop.wait()
        if thread is not None and worker is not None:
            thread.join(10.0)
            worker.close()
