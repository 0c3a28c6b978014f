"""The engines' own call sequences against kvpool with real processes: SGLang's HiCache
`MooncakeStore` (two tensor-parallel ranks with the setup arguments its `MOONCAKE_*` and JSON
file configurations produce, MHA page-first pools with P2P handshake and MLA layer-first pools
with HTTP metadata, then each detached by dropping it), vLLM's `MooncakeStoreWorker` (a producer and a consumer, lookups from a lookup
server thread while the main thread moves blocks) and LMCache's `MooncakestoreConnector`.
Running the engines' modules themselves needs their GPU stacks; these replay the calls they
make (names, arguments, order, threads, lifetimes) as read in SGLang 0.5.23, vLLM 0.33.0 and
LMCache 0.5.6."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool.compat.mooncake.store import MooncakeDistributedStore, ReplicateConfig
from tests.compat.kv import kv_cache
from tests.compat.test_lifecycle import Master, master_with_admin
from tests.support.procs import python_env, stop

MIB = 1 << 20
RANK_SCRIPT = Path(__file__).with_name("sglang_rank.py")


@pytest.fixture(scope="module")
def master() -> Iterator[Master]:
    with master_with_admin("--default_kv_lease_ttl=500") as m:
        yield m


class Rank:
    def __init__(self, rank: int, layout: str, setup_args: list[object]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(RANK_SCRIPT), str(rank), "2", layout, json.dumps(setup_args)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=python_env())

    def read(self) -> dict[str, object]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"rank exited with {self.proc.wait(10)}"
        return dict(json.loads(line))

    def go(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(b"go\n")
        self.proc.stdin.flush()


@pytest.mark.parametrize("layout", ["mha", "mla"])
def test_sglang_hicache_two_tp_ranks(master: Master, layout: str) -> None:
    assert master.segments() == ""  # check_server would keep waiting
    total = 64 * MIB  # MOONCAKE_GLOBAL_SEGMENT_SIZE, split over tp_size ranks
    metadata = "P2PHANDSHAKE" if layout == "mha" else master.metadata  # one per deployment
    from_env = ["localhost", metadata, total // 2, 16 * MIB, "tcp", "", master.address]
    from_file = ["127.0.0.1", metadata, total // 2, 16 * MIB, "tcp", "", master.address]
    ranks = [Rank(0, layout, from_env), Rank(1, layout, from_file)]
    try:
        names = [str(r.read()["hostname"]) for r in ranks]
        assert sorted(master.segments().splitlines()) == sorted(names)
        steps = [{s: r.read() for s in ("set", "set_again")} for r in ranks]
        for r in ranks:  # MLA ranks share keys: read back only once every rank has stored
            r.go()
        for r, step in zip(ranks, steps, strict=True):
            step.update({s: r.read() for s in ("get", "exists")})
        for step in steps:
            assert set(map(int, step["set"]["results"])) == {0}  # type: ignore[call-overload]
            assert set(map(int, step["set_again"]["results"])) == {0}  # type: ignore
            assert step["get"]["equal"] is True and min(step["get"]["results"]) > 0, step  # type: ignore
            exists = step["exists"]["results"]
            assert exists[:4] == [1] * 4 and exists[4] == 0 and set(exists[5:]) == {1}  # type: ignore
        if layout == "mha":
            assert [s["set"]["written"] for s in steps] == [12, 12]  # own keys per rank
        ranks[0].go()
        assert ranks[0].read()["step"] == "detached"
        assert master.segments().splitlines() == [names[1]]  # rank 0 lives on, unmounted
        for r in ranks[1:]:
            r.go()
            assert r.read()["step"] == "detached"
        assert master.segments() == ""
    finally:
        for r in ranks:
            r.go()
            stop(r.proc)  # type: ignore[arg-type]


def test_vllm_producer_and_consumer_with_lookup_thread(master: Master) -> None:
    """Producer: register each layer's KV, skip blocks already stored, store the rest as one
    object per block over every layer. Consumer: the scheduler's lookup server (a thread)
    asks which prefix is stored while the worker loads blocks and logs their tiers."""
    producer, consumer = MooncakeDistributedStore(), MooncakeDistributedStore()
    for store in (producer, consumer):
        assert store.setup("127.0.0.1", "P2PHANDSHAKE", 32 * MIB, 16 * MIB, "tcp", "",
                           master.address) == 0
    try:
        layers = list(kv_cache(8, seed=11).transpose(0, 1).contiguous())
        block = layers[0][0].numel() * 2
        for t in layers:
            assert producer.register_buffer(t.data_ptr(), t.numel() * 2) == 0
        keys = [f"model@tp0@blk{b}" for b in range(8)]
        config = ReplicateConfig()
        config.preferred_segment = producer.get_hostname()
        assert producer.batch_is_exist(keys[:4]) == [0] * 4
        put = producer.batch_put_from_multi_buffers(
            keys[:4], [[t.data_ptr() + b * block for t in layers] for b in range(4)],
            [[block] * len(layers)] * 4, config)
        assert put == [0] * 4
        lookups: list[list[int]] = []

        def lookup_server() -> None:
            for _ in range(20):
                lookups.append(consumer.batch_is_exist_no_lease(keys))
                lookups.append(consumer.batch_is_exist(keys))

        server = threading.Thread(target=lookup_server)
        server.start()
        dest = [t.clone().zero_() for t in layers]
        for t in dest:
            assert consumer.register_buffer(t.data_ptr(), t.numel() * 2) == 0
        got = consumer.batch_get_into_multi_buffers(
            keys[:4], [[t.data_ptr() + b * block for t in dest] for b in range(4)],
            [[block] * len(layers)] * 4)
        tiers = consumer.batch_get_replica_desc(keys[:4])
        server.join(30)
        assert got == [block * len(layers)] * 4
        assert all((d[:4] == s[:4]).all() for d, s in zip(dest, layers, strict=True))
        assert sorted(tiers) == keys[:4] and all(r[0].is_memory_replica()
                                                 for r in tiers.values())
        assert all(row == [1] * 4 + [0] * 4 for row in lookups)
        assert consumer.remove_all(True) == 4
    finally:
        assert producer.close() == 0 and consumer.close() == 0


def test_lmcache_connector_sequence(master: Master) -> None:
    """setup(dict) with `master_server_address`, preferred segment = own hostname, a
    registered staging buffer, put_from / put_parts, is_exist, batch_get_into,
    batch_get_buffer, unregister_buffer, close."""
    import torch

    store = MooncakeDistributedStore()
    assert store.setup({"local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE",
                        "protocol": "tcp", "device_name": "", "global_segment_size": "32MB",
                        "local_buffer_size": "16MB",
                        "master_server_address": master.address}) == 0
    try:
        config = ReplicateConfig()
        config.preferred_segment = store.get_hostname()
        buffer = torch.arange(4096, dtype=torch.int32).view(torch.uint8)
        base = buffer.data_ptr()
        assert store.register_buffer(base, buffer.numel()) == 0
        meta = json.dumps({"shape": [2, 8], "dtype": "bfloat16"}).encode()
        assert store.put_from("chunk0", base, 1024, config) == 0
        assert store.put_parts("chunk1", meta, memoryview(buffer[1024:2048].numpy()),
                               config=config) == 0
        assert store.is_exist("chunk0") == 1 and store.is_exist("chunk9") == 0
        got = store.batch_get_into(["chunk0", "chunk9"], [base + 8192, base + 9216], [1024] * 2)
        assert got == [1024, -704]
        assert bytes(buffer[8192:9216].numpy()) == bytes(buffer[:1024].numpy())
        handles = store.batch_get_buffer(["chunk1", "chunk9"])
        assert handles[1] is None and bytes(handles[0])[:len(meta)] == meta
        assert store.unregister_buffer(base) == 0
    finally:
        assert store.close() == 0
