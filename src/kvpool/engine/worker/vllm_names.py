"""The emulated vLLM face's names for the engine's blocks: what vLLM would call each full prompt
block, and the pool key vLLM's MooncakeStoreConnector would write for it.

The engine names a block by kvpool's chained hash (`engine.blocks.prefix_block_hashes`); a vLLM
names the same block by its own chain (`kvevents.BlockHasher`: the face's
--prefix-caching-hash-algo, PYTHONHASHSEED and block size). `learn` pairs the two for every full
block of a prompt when the prompt arrives, before the engine schedules it, so every block the
engine computes or loads for that prompt has its vLLM name. The table keeps the most recently
learned `capacity` names.

Pool keys. A vLLM with the MooncakeStoreConnector keys a block by its 32-byte hash
(`MODEL@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@HEX`), which is how the master's pool events
(kvevents.pool) tell a router which prefixes the pool holds. The face keys its per-layer objects
the same way, with the layer and the engine's identity root (the weights' digest) in the key's
namespace (`MODEL@kvpool_layer:L@kvpool_weights:ROOT@tp_rank:0@...@HEX`), so an emulated vLLM
fleet's pool is visible to the conductor exactly as a real one's is, and two checkpoints served
under one name (folders of the same name) never read each other's blocks: vLLM's own key holds
the served name and the tokens only. A block the
face has no name for (an output block, a salted prompt's) keeps kvpool's own key
(`engine.blocks.block_key`); the pool publishes nothing for it, and no block is ever read under
another block's key: both names are chains over the same tokens.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple

from kvpool.engine.blocks import block_key, prefix_block_hashes, salted_root
from kvpool.kvevents.hashing import BlockHasher, HashAlgo, to_event_hash

_U64 = (1 << 64) - 1


class BlockName(NamedTuple):
    """vLLM's name of one block: its hash as events carry it, its parent's, its tokens and the
    32-byte digest the store connector's key holds."""

    event_hash: int
    parent: int | None
    tokens: list[int]
    digest: bytes


class VllmBlockNames:
    def __init__(self, block_size: int, root_hash: int, algo: HashAlgo, hash_seed: str | None,
                 model: str, capacity: int) -> None:
        self.block_size, self.root_hash, self.model = block_size, root_hash, model
        self.hasher = BlockHasher(algo, block_size, hash_seed)
        self.capacity = max(1, capacity)
        self._names: OrderedDict[int, BlockName] = OrderedDict()
        """kvpool block hash -> vLLM's name, least recently learned first."""

    def learn(self, prompt_ids: Sequence[int], cache_salt: str | None) -> None:
        """Name the prompt's full blocks (a salted prompt's are not named: the salt enters
        vLLM's first block hash in a way the face does not emulate)."""
        if cache_salt is not None:
            return
        bs = self.block_size
        ours = prefix_block_hashes(prompt_ids, bs, salted_root(self.root_hash, None))
        digests = self.hasher.digests(prompt_ids)
        parent: int | None = None
        for i, h in enumerate(ours):
            theirs = to_event_hash(digests[i])
            assert isinstance(theirs, int)
            if h in self._names:
                self._names.move_to_end(h)
            else:
                self._names[h] = BlockName(theirs, parent, list(prompt_ids[i * bs:(i + 1) * bs]),
                                           digests[i])
            parent = theirs
        while len(self._names) > self.capacity:
            self._names.popitem(last=False)

    def name(self, block_hash: int) -> BlockName | None:
        return self._names.get(block_hash)

    def pool_key(self, block_hash: int, layer: int | None = None) -> str:
        """The pool key of the block's KV (one layer's, or all layers' when `layer` is None)."""
        name = self._names.get(block_hash)
        if name is None:
            return block_key(block_hash, layer)
        namespace = "" if layer is None else f"@kvpool_layer:{layer}"
        return (f"{self.model}{namespace}@kvpool_weights:{self.root_hash & _U64:016x}"
                f"@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@{name.digest.hex()}")
