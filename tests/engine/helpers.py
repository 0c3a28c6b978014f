"""Running our model outside the engine, for comparisons."""

from __future__ import annotations

import torch

from kvpool.engine.config import EngineConfig
from kvpool.engine.kv_cache import KVCache
from kvpool.engine.model import AttentionBatch, CausalLM, SeqSlice


def full_logits(model: CausalLM, ids: list[int], block_size: int = 16) -> torch.Tensor:
    """Logits [len(ids), vocab] of one plain forward pass over a fresh paged cache."""
    num_blocks = -(-len(ids) // block_size)
    cache = KVCache(model.config, EngineConfig(block_size=block_size, num_blocks=num_blocks),
                    next(model.parameters()).dtype, "cpu")
    table = torch.arange(num_blocks)
    batch = AttentionBatch(torch.arange(len(ids)), [SeqSlice(0, len(ids), len(ids), table)])
    hidden = model(torch.tensor(ids), torch.arange(len(ids)), batch, cache.kv)
    return model.logits(hidden)
