"""`kvpool master --kv-events-endpoint`: a real master process publishes the pool's blocks as
vLLM KV events, read by kvpool's own subscriber (put, eviction, removal, wipe, replay)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import zmq

from kvpool.kvevents.codec import decode_batch
from kvpool.kvevents.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvpool.kvevents.hashing import to_event_hash
from kvpool.kvevents.index import CacheIndex
from kvpool.kvevents.subscriber import KvEventSubscriber, fetch_replay
from kvpool.store.client.config import ClientConfig
from kvpool.store.client.store_client import StoreClient
from tests.support.net import free_port, wait_port
from tests.support.procs import running, spawn_kvpool
from tests.support.wait import wait_for

MIB = 1 << 20


def block_key(n: int) -> str:
    """A MooncakeStoreConnector key (vLLM 0.32) naming block digest n."""
    return f"/models/m@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@{n:064x}"


def block(n: int) -> int:
    return to_event_hash(n.to_bytes(32, "big"))


@pytest.fixture(scope="module")
def pool() -> Iterator[tuple[KvEventSubscriber, CacheIndex, str, StoreClient]]:
    index = CacheIndex()
    sub = KvEventSubscriber("tcp://127.0.0.1:0", index, replay_timeout_s=2.0)
    replay = f"tcp://127.0.0.1:{free_port()}"
    sub.set_replay_endpoint("pool", replay)
    rpc, admin = free_port(), free_port()
    proc = spawn_kvpool("master", "--rpc-port", str(rpc), "--admin-port", str(admin),
                        "--lease-ttl-ms", "50", "--kv-events-endpoint", sub.endpoint,
                        "--kv-events-replay-endpoint", replay, "--kv-events-topic", "pool",
                        "--kv-events-block-size", "16")
    with running(proc):
        wait_port(rpc)
        sub.start()
        with StoreClient(ClientConfig(master=f"127.0.0.1:{rpc}", global_segment_size=8 * MIB,
                                      local_buffer_size=2 * MIB)) as client:
            yield sub, index, replay, client
        sub.close()


def held(index: CacheIndex, client: StoreClient, blocks: range) -> tuple[list[bool], list[bool]]:
    """Per block: in the subscriber's view of the pool, and in the pool itself."""
    return ([index.matched_blocks("pool", [block(n)], "cpu") == 1 for n in blocks],
            [client.exists(block_key(n)) == 0 for n in blocks])


def agree(index: CacheIndex, client: StoreClient, blocks: range) -> bool:
    seen, real = held(index, client, blocks)
    return seen == real


def test_put_evict_remove_wipe_and_replay(pool: tuple[KvEventSubscriber, CacheIndex, str, StoreClient]) -> None:
    sub, index, replay, client = pool
    chunk = b"x" * MIB
    for n in (1, 2, 3):
        assert client.put(block_key(n), chunk).ok
    assert client.put("not-a-block", b"y").ok  # publishes nothing
    wait_for(lambda: index.matched_blocks("pool", [block(1), block(2), block(3)], "cpu") == 3)
    assert index.matched_blocks("pool", [block(1)], "gpu") == 0 and index.num_blocks("pool", "cpu") == 3
    time.sleep(0.1)  # the read leases are over: blocks may be evicted
    for n in range(4, 10):  # 9 MiB into an 8 MiB segment: eviction
        assert client.put(block_key(n), chunk).ok
    everything = range(1, 10)
    wait_for(lambda: agree(index, client, everything), what=lambda: held(index, client, everything))
    kept = [n for n in everything if client.exists(block_key(n)) == 0]
    assert 0 < len(kept) < 9
    assert client.remove(block_key(kept[-1])) == 0
    wait_for(lambda: index.matched_blocks("pool", [block(kept[-1])], "cpu") == 0)
    assert client.remove_all(force=True) == len(kept)  # the other blocks and "not-a-block"
    wait_for(lambda: index.stats("pool").num_cleared_events == 1)
    assert index.num_blocks("pool", "cpu") == 0
    stats = sub.stats("pool")
    assert stats.num_gaps == 0 and not stats.partial and stats.num_malformed == 0

    history = fetch_replay(zmq.Context.instance(), replay, 0, 2000)
    assert [seq for seq, _ in history] == list(range(stats.last_seq + 1))
    events = [e for _, payload in history for e in decode_batch(payload).events]
    assert events[-1] == AllBlocksCleared()
    stored = [e for e in events if isinstance(e, BlockStored)]
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    assert sorted(h for e in stored for h in e.block_hashes) == [block(n) for n in everything]
    assert sorted(h for e in removed for h in e.block_hashes) == [block(n) for n in everything]
    assert {(e.medium, e.block_size, e.parent_block_hash) for e in stored} == {("cpu", 16, None)}


def test_objects_held_before_the_publisher_starts_are_announced() -> None:
    """A master whose table is not empty when it starts (a replayed journal) announces it."""
    from kvpool.kvevents.pool import PoolEventsConfig
    from kvpool.store.master.server import MasterServer, MasterServerConfig

    index = CacheIndex()
    sub = KvEventSubscriber("tcp://127.0.0.1:0", index)
    replay = f"tcp://127.0.0.1:{free_port()}"
    sub.set_replay_endpoint("early", replay)
    cfg = MasterServerConfig(rpc_port=0, admin_port=0, enable_http_metadata=False,
                             kv_events=PoolEventsConfig(sub.endpoint, replay, "early"))
    master = MasterServer(cfg)
    assert master.core.mount_segment("c0", "127.0.0.1:9000", 0x10000, 4 * MIB)[0] == 0
    for n in (5, 6):
        assert master.core.put_start("w", [block_key(n)], [1024])[0].code == 0
        assert master.core.put_end("w", [block_key(n)]) == [0]
    sub.start()
    master.start()
    try:
        wait_for(lambda: index.matched_blocks("early", [block(5), block(6)], "cpu") == 2)
        assert not sub.stats("early").partial
    finally:
        master.stop()
        sub.close()
