"""The emulated vLLM face's KV events, as vLLM publishes them (`--kv-events-config`): the
engine's own block events (kvpool's hashes, `BlockManager.events_since`) renamed to the hashes
vLLM would give the same blocks (`kvevents.BlockHasher`: the face's --prefix-caching-hash-algo,
PYTHONHASHSEED and block size) and published on a ZMQ PUB socket that connects to the
subscriber's endpoint, under the configured topic, with sequence numbers (and a replay socket
if configured).

A block is renamed once the face has seen a prompt holding it (`learn`); blocks it never saw
(output blocks, salted prompts) are not published, so the subscriber learns a subset of what
the engine caches, never a block it does not hold.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvpool.engine.blocks import prefix_block_hashes, salted_root
from kvpool.engine.worker.runtime import Worker
from kvpool.errors import ConfigError
from kvpool.kvevents.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from kvpool.kvevents.hashing import BlockHasher
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
    def __init__(self, worker: Worker, config: KvEventsConfig, algo: str) -> None:
        self.worker = worker
        self.block_size = worker.engine.config.block_size
        self.hasher = BlockHasher(algo, self.block_size,  # type: ignore[arg-type]
                                  os.environ.get("PYTHONHASHSEED"))
        self.publisher = KvEventPublisher(config.endpoint, config.replay_endpoint,
                                          topic=config.topic, bind=False)
        self._names: dict[int, tuple[int, int | None, list[int]]] = {}
        """kvpool block hash -> (vLLM's hash, its parent's, the block's tokens)."""
        self._since: int | None = None
        self._published: set[int] = set()

    def learn(self, prompt_ids: Sequence[int], cache_salt: str | None) -> None:
        """Remember vLLM's names of the prompt's full blocks (a salted prompt's are not
        published: the salt enters vLLM's first block hash in a way the face does not
        emulate)."""
        if cache_salt is not None:
            return
        bs, root = self.block_size, salted_root(self.worker.engine.root_hash, None)
        ours = prefix_block_hashes(prompt_ids, bs, root)
        theirs = [int(h) for h in self.hasher.block_hashes(prompt_ids)]
        for i, h in enumerate(ours):
            if h not in self._names:
                self._names[h] = (theirs[i], theirs[i - 1] if i else None,
                                  list(prompt_ids[i * bs:(i + 1) * bs]))

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
        self._prune()

    def _event(self, h: int, stored: bool) -> Any:
        name = self._names.get(h)
        if name is None:
            return None
        theirs, parent, tokens = name
        if stored and theirs not in self._published:
            self._published.add(theirs)
            return BlockStored(block_hashes=[theirs], parent_block_hash=parent, token_ids=tokens,
                               block_size=self.block_size, medium=MEDIUM)
        if not stored:
            del self._names[h]  # learned again when a prompt holding it comes back
            if theirs in self._published:
                self._published.discard(theirs)
                return BlockRemoved(block_hashes=[theirs], medium=MEDIUM)
        return None

    def _prune(self) -> None:
        """Forget the names of blocks learned but never cached (requests aborted before their
        prefill), once they outnumber the engine's blocks: the table stays bounded."""
        if len(self._names) > 2 * self.worker.engine.config.num_blocks + 1024:
            self._names = {h: n for h, n in self._names.items() if n[0] in self._published}
