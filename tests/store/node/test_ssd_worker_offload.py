"""The disk tier's worker against a real master: an offload older than the file its key
already has (a task handed out again after its reply was lost, overtaken by later ones) is
refused, so the newer copy the master counts on is never replaced by an older one; and an
unexpected failure does not end the disk tier's thread."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import xxhash

from kvpool.store.client.config import ClientConfig
from kvpool.store.client.store_client import StoreClient
from kvpool.store.config import MasterConfig
from kvpool.store.master.server import MasterServer, MasterServerConfig
from kvpool.store.master.tier_tasks import DONE, FAILED
from kvpool.store.node.ssd_worker import SsdConfig, SsdWorker


@pytest.fixture
def worker(tmp_path: Path) -> Iterator[tuple[SsdWorker, StoreClient]]:
    server = MasterServerConfig(rpc_port=0, admin_port=0, enable_http_metadata=False)
    master = MasterServer(server, MasterConfig()).start()
    try:
        with StoreClient(ClientConfig(master=master.address, global_segment_size=1 << 20,
                                      local_buffer_size=0)) as client:
            ssd = SsdWorker(client, SsdConfig(root=str(tmp_path / "disk"), size_bytes=1 << 20))
            try:
                yield ssd, client
            finally:
                ssd.close()
    finally:
        master.stop()


def test_an_offload_older_than_the_keys_file_is_refused(
        worker: tuple[SsdWorker, StoreClient]) -> None:
    ssd, client = worker
    old, new = np.full(4096, 1, np.uint8), np.full(4096, 2, np.uint8)
    client.register_buffer(old)
    client.register_buffer(new)
    for value, gen in ((new, 0x2222), (old, 0x1111)):  # the newer file first, then the stale task
        outcome = ssd._offload("k", value.ctypes.data, 4096,
                               xxhash.xxh3_64_intdigest(value), gen, 0)
        assert outcome == (DONE if gen == 0x2222 else FAILED)
    entry = ssd.store.entries["k"]
    assert entry.gen == 0x2222
    back = memoryview(bytearray(4096))
    assert ssd.store.read_into("k", 0x2222, back) and bytes(back) == new.tobytes()
    assert ssd._offload("k", new.ctypes.data, 4096, xxhash.xxh3_64_intdigest(new),
                        0x2222, 0) == DONE                 # the same generation again: fine


def test_an_unexpected_failure_does_not_end_the_disk_tier(
        worker: tuple[SsdWorker, StoreClient], monkeypatch: pytest.MonkeyPatch) -> None:
    ssd, _ = worker
    attach, calls = ssd._attach, []

    def failing_once() -> bool:
        calls.append(1)
        if len(calls) == 1:
            raise ValueError("a bug")
        return attach()
    monkeypatch.setattr(ssd, "_attach", failing_once)
    stop = threading.Event()
    thread = threading.Thread(target=ssd.run, args=(stop,), daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while ssd.segment_id is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ssd.segment_id is not None and len(calls) >= 2
    finally:
        stop.set()
        thread.join(10)
