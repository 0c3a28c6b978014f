"""Typed KV-cache events, the shape vLLM's engines and kvpool's master publish.

One `EventBatch` is one ZMQ message: a timestamp, the events of one engine step in order, and
the data-parallel rank that produced them. Block hashes are `bytes` (a full digest) or `int`
(vLLM's default on the wire: the low 64 bits of the digest, big-endian); `BlockHash` names the
union. `medium` says which cache tier holds the blocks ("GPU" from vLLM's own cache; "cpu" and
"disk" from kvpool's pool); None means the publisher did not say (treated as the GPU cache).

These are values: frozen, compared by field. The codec turns them into vLLM's bytes and back
(`kvpool.kvevents.codec`); nothing here touches a socket.
"""

from __future__ import annotations

from typing import Any

import msgspec

BlockHash = bytes | int
"""A block's hash as events carry it: the digest, or its low 64 bits as an unsigned int."""

MEDIUM_GPU = "gpu"
MEDIUM_CPU = "cpu"
MEDIUM_DISK = "disk"


def normalize_medium(medium: str | None) -> str:
    """The tier a `medium` field names, lower-cased; None (unsaid) is the engine's GPU cache.

    vLLM writes "GPU" / "CPU" / "STORAGE"; kvpool's master writes "cpu" / "disk". "storage"
    is read as disk.
    """
    if medium is None:
        return MEDIUM_GPU
    lowered = medium.lower()
    return MEDIUM_DISK if lowered == "storage" else lowered


class BlockStored(msgspec.Struct, frozen=True, kw_only=True):
    """Consecutive full blocks now cached, each chained on the one before it.

    `parent_block_hash` is the hash of the block before `block_hashes[0]` (None for a
    request's first block); `token_ids` are the tokens of all the blocks, in order.
    `extra_keys` has one entry per block (LoRA name, multimodal ids, cache salt) as vLLM
    publishes them (untagged). The fields from `group_idx` on appeared in later vLLM releases.
    """

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None = None
    token_ids: list[int] = msgspec.field(default_factory=list)
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(msgspec.Struct, frozen=True, kw_only=True):
    """Blocks no longer cached on `medium`."""

    block_hashes: list[BlockHash]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(msgspec.Struct, frozen=True):
    """Every block of the publisher is gone (a cache reset, a wiped pool)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, frozen=True, kw_only=True):
    """The events of one publish, in order. `ts` is the publisher's wall-clock time (s)."""

    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None
