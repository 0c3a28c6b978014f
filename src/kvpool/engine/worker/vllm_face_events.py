"""The emulated vLLM face's KV events, as vLLM publishes them (`--kv-events-config`): the
engine's own block events (kvpool's hashes, `BlockManager.events_since`) renamed to the hashes
vLLM would give the same blocks (engine/worker/vllm_names.py: the face's
--prefix-caching-hash-algo, PYTHONHASHSEED and block size) and published on a ZMQ PUB socket that connects to the
subscriber's endpoint, under the configured topic, with sequence numbers (and a replay socket
if configured).

A block is renamed once the face has seen a prompt holding it (`VllmBlockNames.learn`); blocks
it never saw (output blocks, salted prompts) are not published, so the subscriber learns a
subset of what the engine caches, never a block it does not hold: a removal goes out under the
name its block was published with.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any

from kvpool.engine.worker.runtime import Worker
from kvpool.engine.worker.vllm_names import VllmBlockNames
from kvpool.errors import ConfigError
from kvpool.kvevents.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from kvpool.kvevents.publisher import KvEventPublisher
from kvpool.log import get_logger

log = get_logger("engine.worker.vllm_face")
POLL_S = 0.05
MEDIUM = "GPU"
"""What vLLM's own cache calls itself in its events."""


@dataclass(frozen=True, slots=True)
class KvEventsConfig:
    """The fields of vLLM's --kv-events-config the face reads."""

    endpoint: str
    topic: str = ""
    replay_endpoint: str | None = None

    @classmethod
    def parse(cls, text: str) -> KvEventsConfig | None:
        """None when events are not enabled; ConfigError for a config vLLM would refuse."""
        try:
            obj: dict[str, Any] = json.loads(text)
        except ValueError as exc:
            raise ConfigError(f"--kv-events-config is not JSON: {exc}") from None
        if not obj.get("enable_kv_cache_events"):
            return None
        if obj.get("publisher", "zmq") != "zmq" or not obj.get("endpoint"):
            raise ConfigError("--kv-events-config: the face publishes with publisher zmq to an "
                              f"endpoint; got {text!r}")
        return cls(str(obj["endpoint"]), str(obj.get("topic", "")),
                   obj.get("replay_endpoint") or None)


class FaceEvents:
    def __init__(self, worker: Worker, config: KvEventsConfig, names: VllmBlockNames) -> None:
        self.worker = worker
        self.block_size = worker.engine.config.block_size
        self.names = names
        self.publisher = KvEventPublisher(config.endpoint, config.replay_endpoint,
                                          topic=config.topic, bind=False)
        self._since: int | None = None
        self._published: dict[int, int] = {}
        """kvpool block hash -> the vLLM hash it was published under."""

    async def run(self) -> None:
        """Publish the engine's block events every POLL_S until cancelled."""
        try:
            while True:
                await self._publish_new()
                await asyncio.sleep(POLL_S)
        finally:
            self.publisher.close()

    async def _publish_new(self) -> None:
        w = self.worker
        load = await w.load(w.epoch, self._since)
        events: list[Any] = []
        if load.block_events is None:  # the first poll, or events were trimmed: all of it
            events.append(AllBlocksCleared())
            self._published.clear()
            changes = [(h, True) for h in load.block_hashes or ()]
        else:
            changes = list(load.block_events)
        self._since = load.events_to
        for h, stored in changes:
            event = self._event(h, stored)
            if event is not None:
                events.append(event)
        if events:
            self.publisher.publish(EventBatch(ts=time.time(), events=events,
                                              data_parallel_rank=None))

    def _event(self, h: int, stored: bool) -> Any:
        if not stored:
            theirs = self._published.pop(h, None)
            return None if theirs is None else BlockRemoved(block_hashes=[theirs], medium=MEDIUM)
        name = self.names.name(h)
        if name is None or h in self._published:
            return None
        self._published[h] = name.event_hash
        return BlockStored(block_hashes=[name.event_hash], parent_block_hash=name.parent,
                           token_ids=name.tokens, block_size=self.block_size, medium=MEDIUM)
