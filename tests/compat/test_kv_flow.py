"""The store call sequences of vLLM's MooncakeStoreConnector (layer-wise KV, multi-buffer) and
SGLang's HiCache (page-first KV, one buffer per page), between real processes, and replicas
that survive the loss of one store."""

from __future__ import annotations

import signal
import time

import numpy as np
import torch

from kvpool.compat.mooncake.store import MooncakeDistributedStore, ReplicateConfig
from tests.compat.conftest import MIB, Master, StoreFactory
from tests.compat.kv import NUM_LAYERS, PAGE_BYTES, kv_cache
from tests.support.procs import running, spawn_kvpool, spawn_python, stop

LAYER_PAGE_BYTES = PAGE_BYTES // NUM_LAYERS
PREFILL_SIDE = """
import sys
from kvpool.compat.mooncake.store import MooncakeDistributedStore
from tests.compat.kv import kv_cache
store = MooncakeDistributedStore()
assert store.setup("127.0.0.1", "P2PHANDSHAKE", 64 << 20, 16 << 20, "tcp", "", sys.argv[1]) == 0
layers = list(kv_cache(16, seed=5).transpose(0, 1).contiguous())  # 32 x [pages, 2, ...]
for t in layers:
    assert store.register_buffer(t.data_ptr(), t.numel() * t.element_size()) == 0
pages = [2, 3, 7, 11]
keys = [f"blk-{p}" for p in pages]
assert store.batch_is_exist(keys) == [0] * 4
n = layers[0][0].numel() * 2
ptrs = [[t.data_ptr() + p * n for t in layers] for p in pages]
sizes = [[n] * len(layers) for _ in pages]
print(store.batch_put_from_multi_buffers(keys, ptrs, sizes), store.get_hostname(), flush=True)
sys.stdin.readline()
store.close()
"""


def test_vllm_layerwise_kv_between_processes(master: Master, make_store: StoreFactory) -> None:
    store = make_store(segment=0)  # a pure client: every byte comes from the other process
    with running(spawn_python(PREFILL_SIDE, master.address)) as child:
        assert child.stdout is not None and child.stdin is not None
        line = child.stdout.readline().decode()
        assert line.startswith("[0, 0, 0, 0] 127.0.0.1:"), line
        producer = line.split()[-1]
        keys = [f"blk-{p}" for p in (2, 3, 7, 11)]
        assert store.batch_is_exist(keys + ["blk-99"]) == [1, 1, 1, 1, 0]
        layers = [torch.zeros((16, 2, 4, 2, 8), dtype=torch.float16) for _ in range(NUM_LAYERS)]
        for t in layers:
            assert store.register_buffer(t.data_ptr(), t.numel() * 2) == 0
        dst_pages = [0, 1, 5, 15]
        ptrs = [[t.data_ptr() + d * LAYER_PAGE_BYTES for t in layers] for d in dst_pages]
        sizes = [[LAYER_PAGE_BYTES] * NUM_LAYERS for _ in dst_pages]
        assert store.batch_get_into_multi_buffers(keys, ptrs, sizes) == [PAGE_BYTES] * 4
        expected = kv_cache(16, seed=5).transpose(0, 1)
        got = torch.stack(layers)  # [layers, pages, 2, ...]
        for src, dst in zip((2, 3, 7, 11), dst_pages, strict=True):
            assert torch.equal(got[:, dst], expected[:, src])
        descs = store.batch_get_replica_desc(keys)
        assert {d[0].get_memory_descriptor().buffer_descriptor.transport_endpoint
                for d in descs.values()} == {producer}
        assert store.remove_all(force=True) == 4
        child.stdin.write(b"done\n")
        child.stdin.flush()
        assert child.wait(20) == 0


def test_sglang_page_first_exists_then_put(make_store: StoreFactory) -> None:
    writer, reader = make_store(), make_store(segment=0)
    cache = kv_cache(8, seed=9)
    assert writer.register_buffer(cache.data_ptr(), cache.numel() * 2) == 0
    keys = [f"page-{i}" for i in range(8)]
    exists = writer.batch_is_exist(keys)
    todo = [i for i, e in enumerate(exists) if e != 1]
    assert todo == list(range(8))
    assert writer.batch_put_from([keys[i] for i in todo],
                                 [cache.data_ptr() + i * PAGE_BYTES for i in todo],
                                 [PAGE_BYTES] * len(todo)) == [0] * 8
    out = torch.zeros_like(cache)
    assert reader.register_buffer(out.data_ptr(), out.numel() * 2) == 0
    order = [7, 0, 3]
    assert reader.batch_get_into([keys[i] for i in order],
                                 [out.data_ptr() + j * PAGE_BYTES for j in range(3)],
                                 [PAGE_BYTES] * 3) == [PAGE_BYTES] * 3
    assert torch.equal(out[:3], cache[order])


def test_replicas_survive_the_close_of_one_store(master: Master) -> None:
    nodes = [spawn_kvpool("store-node", "--dram", "16MiB", "--master", master.address,
                          "--heartbeat-interval", "0.2") for _ in range(2)]
    client = MooncakeDistributedStore()
    try:
        assert client.setup({"local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE",
                             "global_segment_size": 0, "local_buffer_size": "4MB",
                             "protocol": "tcp", "master_server_address": master.address}) == 0
        value = np.random.default_rng(1).integers(0, 255, 256 << 10, dtype=np.uint8).tobytes()
        cfg = ReplicateConfig()
        cfg.replica_num = 2
        _wait_for_put(client, value, cfg)
        endpoints = {d.get_memory_descriptor().buffer_descriptor.transport_endpoint
                     for d in client.get_replica_desc("replicated")}
        assert len(endpoints) == 2
        stop(nodes[0], signal.SIGTERM)
        assert client.get("replicated") == value
        assert len(client.get_replica_desc("replicated")) == 1
        assert client.remove("replicated", force=True) == 0
    finally:
        client.close()
        for node in nodes:
            stop(node)


def _wait_for_put(client: MooncakeDistributedStore, value: bytes, cfg: ReplicateConfig) -> None:
    """Both store nodes must have mounted before a two-replica put can place both copies."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        rc = client.upsert("replicated", value, cfg)
        assert rc in (0, -200)  # -200 until a node has mounted its memory
        if rc == 0 and len(client.get_replica_desc("replicated")) == 2:
            return
        time.sleep(0.1)
    raise AssertionError("the two store nodes never both held a replica")


__all__ = ["MIB"]
