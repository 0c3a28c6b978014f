"""P/D through a store connector: the decode leg waits for the prompt's blocks to land in the
pool (vLLM's MooncakeStoreConnector writes them after the prefill reply has gone out). Real ZMQ
sockets on 127.0.0.1: the proxy's event feed, and the pool's events published as the kvpool
master publishes them, late, in part, or never."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import pytest

from kvpool.engine.worker.messages import InfoReply
from kvpool.kvevents.events import BlockStored, EventBatch
from kvpool.kvevents.publisher import KvEventPublisher
from kvpool.serve.vllm.backend import HANDOFF_STALL_S, SILENT_POOL_WAITS, VllmBackend
from kvpool.serve.vllm.events import KvEventsFeed
from tests.support.wait import wait_for

BLOCK = 16
URL = "http://127.0.0.1:1"
PROMPT = list(range(1, 5 * BLOCK + 4))  # five full blocks
REFERENCE = InfoReply(role="prefill", model="m", model_hash=1, block_size=BLOCK,
                      max_model_len=4096, kv_capacity_tokens=1 << 16,
                      engine={"kind": "vllm", "hash_algo": "sha256"})


@pytest.fixture
def feed() -> Iterator[KvEventsFeed]:
    f = KvEventsFeed("tcp://127.0.0.1:0", "sha256", pool_topic="pool")
    yield f
    f.close()


def backend(feed: KvEventsFeed, wait_s: float) -> VllmBackend:
    return VllmBackend({URL: "prefill"}, 5.0, model="m", block_size=BLOCK, events=feed,
                       handoff_wait_s=wait_s)


def stored(hashes: list[int]) -> EventBatch:
    return EventBatch(ts=1.0, events=[BlockStored(block_hashes=hashes, token_ids=[],
                                                  block_size=BLOCK, medium="CPU")])


def publisher(feed: KvEventsFeed) -> KvEventPublisher:
    """The pool's publisher, once the feed has heard from it."""
    pub = KvEventPublisher(feed.endpoint, None, "pool")

    def heard() -> bool:
        pub.publish(stored([12345]))
        return feed.pool_heard()

    wait_for(heard, timeout_s=10)
    return pub


def handoff(b: VllmBackend, salt: str | None = None) -> float:
    """How long the decode leg was held (checked against what the backend says it waited),
    for the chain the backend gives the prompt when it is scheduled."""
    chain = b.block_hashes(PROMPT, salt, REFERENCE)
    start = time.monotonic()
    waited = asyncio.run(b.handoff(URL, "r", chain))
    took = time.monotonic() - start
    assert waited is None and took < 0.05 or waited is not None and 0 <= waited <= took
    return took


def later(delay_s: float, pub: KvEventPublisher, hashes: list[int]) -> None:
    threading.Timer(delay_s, pub.publish, (stored(hashes),)).start()


def test_the_decode_leg_waits_for_blocks_that_land_after_the_reply(feed: KvEventsFeed) -> None:
    pub = publisher(feed)
    try:
        b = backend(feed, 5.0)
        hashes = feed.hashes(PROMPT, BLOCK, "sha256")
        assert len(hashes) == 5 and feed.pool_blocks(hashes) == 0
        later(0.3, pub, hashes[:2])
        later(0.6, pub, hashes[2:])
        took = handoff(b)
        assert feed.pool_blocks(hashes) == 5
        assert 0.55 <= took < 3.0, took
        assert handoff(b) < 0.1  # all there already
        assert handoff(b, salt="tenant") < 0.1  # a salted chain is not the one computed here
    finally:
        pub.close()


def test_blocks_that_stop_landing_hold_the_decode_leg_only_a_moment(feed: KvEventsFeed) -> None:
    pub = publisher(feed)
    try:
        hashes = feed.hashes(PROMPT, BLOCK, "sha256")
        later(0.2, pub, hashes[:3])  # the pool refused the other two (full)
        took = handoff(backend(feed, 5.0))
        assert feed.pool_blocks(hashes) == 3
        assert 0.2 + HANDOFF_STALL_S - 0.05 <= took < 2.0, took
    finally:
        pub.close()


def test_a_pool_that_never_publishes_is_waited_for_a_few_times_then_not(
        feed: KvEventsFeed) -> None:
    b = backend(feed, 0.2)
    for _ in range(SILENT_POOL_WAITS):
        assert 0.2 <= handoff(b) < 1.0
    assert handoff(b) < 0.05
    assert handoff(backend(feed, 0.0)) < 0.05  # 0: no wait at all
