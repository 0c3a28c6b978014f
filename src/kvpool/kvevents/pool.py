"""The pool's objects as vLLM KV events: store keys -> block hashes, media -> events.

`PoolEventTranslator` is a master `PoolEventSink` (store/master/pool_events.py) that turns
"key K gained/lost medium M" into BlockStored / BlockRemoved events for the block hash K
names, and a wipe into AllBlocksCleared, handing each event to `emit` (a publisher's
`submit`). Sans-I/O; called on the master core's thread.

Key -> block hash. vLLM's MooncakeStoreConnector writes keys of the form

    [cache_prefix@]MODEL[namespace]@tp_rank:T@pcp P@dcp D@pp_rank:R@group:G@HEX

where HEX is the 64-hex-digit SHA-256 block hash (the last block hash of the chunk when the
connector's block size is a multiple of the hash block size). `mooncake_block_digest` reads
that last field; events carry it as vLLM does: its low 64 bits as an int (default) or the
32 bytes (`int_hashes=False`, the engine's VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0).

What it cannot know: the parent hash and the token ids (the key has neither: events carry
`parent_block_hash=None`, `token_ids=[]`, and `block_size` as configured, 0 when unset);
whether every tensor-/pipeline-parallel rank's copy of a block is present (one key per rank:
a block is announced when the first rank's key arrives and withdrawn when the last one goes);
the model, LoRA or cache salt behind the hash (beyond what the hash itself folds in); keys
of other writers (SGLang, LMCache, kvpool's own engine) name no vLLM block hash and publish
nothing (counted in `num_unmapped_keys`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvpool.errors import ConfigError
from kvpool.kvevents.events import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored
from kvpool.kvevents.hashing import to_event_hash

HEX_DIGITS = frozenset("0123456789abcdef")


def mooncake_block_digest(key: str) -> bytes | None:
    """The 32-byte block hash a MooncakeStoreConnector key names, None for another key."""
    head, sep, tail = key.rpartition("@")
    if not sep or len(tail) != 64 or not set(tail) <= HEX_DIGITS or "@group:" not in head:
        return None
    return bytes.fromhex(tail)


class PoolEventTranslator:
    def __init__(
        self,
        emit: Callable[[Any], None],
        int_hashes: bool = True,
        block_size: int = 0,
        key_digest: Callable[[str], bytes | None] = mooncake_block_digest,
    ) -> None:
        self._emit = emit
        self._int_hashes = int_hashes
        self._block_size = block_size
        self._key_digest = key_digest
        self._holders: dict[tuple[BlockHash, str], int] = {}
        """(event hash, medium) -> how many keys hold that block there."""
        self.num_unmapped_keys = 0

    def stored(self, key: str, medium: str) -> None:
        block = self._block_of(key)
        if block is None:
            self.num_unmapped_keys += 1
            return
        count = self._holders.get((block, medium), 0)
        self._holders[(block, medium)] = count + 1
        if count == 0:
            self._emit(BlockStored(block_hashes=[block], parent_block_hash=None, token_ids=[],
                                   block_size=self._block_size, medium=medium))

    def removed(self, key: str, medium: str) -> None:
        block = self._block_of(key)
        count = self._holders.get((block, medium), 0) if block is not None else 0
        if count == 0:
            return
        if count > 1:
            self._holders[(block, medium)] = count - 1  # type: ignore[index]
            return
        del self._holders[(block, medium)]  # type: ignore[arg-type]
        self._emit(BlockRemoved(block_hashes=[block], medium=medium))  # type: ignore[list-item]

    def cleared(self) -> None:
        self._holders.clear()
        self._emit(AllBlocksCleared())

    def num_blocks(self, medium: str) -> int:
        return sum(1 for (_, m) in self._holders if m == medium)

    def _block_of(self, key: str) -> BlockHash | None:
        digest = self._key_digest(key)
        return None if digest is None else to_event_hash(digest, self._int_hashes)


@dataclass(frozen=True)
class PoolEventsConfig:
    """Where the master publishes the pool's KV events (off unless a master is given one)."""

    endpoint: str
    """ZMQ PUB endpoint: connects to host:port (the router binds), binds tcp://*:PORT."""
    replay_endpoint: str | None = None
    """ROUTER endpoint serving replays of the last `buffer_steps` batches (bound)."""
    topic: str = "kvpool-pool"
    """The topic every message carries (subscribers tell publishers apart by it)."""
    block_size: int = 0
    """Tokens per block written in BlockStored (the engines' block size; 0: not said)."""
    int_hashes: bool = True
    """Hashes as vLLM's default ints (low 64 bits); False: the 32-byte digests."""
    buffer_steps: int = 10_000

    def __post_init__(self) -> None:
        if not self.endpoint.startswith(("tcp://", "ipc://", "inproc://")):
            raise ConfigError(f"KV events endpoint must be tcp://, ipc:// or inproc://, "
                              f"got {self.endpoint!r}")
        if self.block_size < 0 or self.buffer_steps < 1:
            raise ConfigError(f"block_size must be >= 0 and buffer_steps >= 1, got "
                              f"{self.block_size}, {self.buffer_steps}")
