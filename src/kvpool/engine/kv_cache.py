"""The KV tensor pool and the byte addresses of its blocks.

One contiguous tensor holds every layer's K and V:

    kv [num_layers, num_blocks, 2, block_size, num_kv_heads, head_dim]
         layer      block      K|V token in block

so the K (or V) of one block of one layer is `block_bytes` contiguous bytes at
`addr(layer, kind, block)`, and its V follows its K: the pool's per-layer object of a block
(K then V) is one contiguous range, `layer_part(block, layer)`, and one gather of a layer's
blocks fetches K and V together. The whole tensor is registered once with the transfer engine, which
lets the pool (puts and gets) and pushes move blocks without copies.
"""

from __future__ import annotations

import torch

from kvpool.engine.config import EngineConfig, ModelConfig

K, V = 0, 1


class KVCache:
    def __init__(self, model: ModelConfig, engine: EngineConfig, dtype: torch.dtype,
                 device: str) -> None:
        self.num_layers = model.num_layers
        self.num_blocks, self.block_size = engine.num_blocks, engine.block_size
        self.kv = torch.zeros(model.num_layers, engine.num_blocks, 2, engine.block_size,
                              model.num_kv_heads, model.head_dim, dtype=dtype, device=device)
        self.block_bytes = self.kv[0, 0, 0].numel() * self.kv.element_size()

    @property
    def base_addr(self) -> int:
        return int(self.kv.data_ptr())

    @property
    def num_bytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def addr(self, layer: int, kind: int, block_id: int) -> int:
        return self.base_addr + ((layer * self.num_blocks + block_id) * 2 + kind) * self.block_bytes

    def layer_part(self, block_id: int, layer: int) -> tuple[int, int]:
        """(addr, bytes) of one block's K then V in one layer: one contiguous range."""
        return self.addr(layer, K, block_id), 2 * self.block_bytes

    def block_parts(self, block_id: int) -> list[tuple[int, int]]:
        """(addr, bytes) of K then V for each layer: one block's KV as scattered parts."""
        return [(self.addr(layer, kind, block_id), self.block_bytes)
                for layer in range(self.num_layers) for kind in (K, V)]

    def block(self, block_id: int) -> torch.Tensor:
        """A copy of one block's KV for all layers: [num_layers, 2, block_size, nkv, D]."""
        return self.kv[:, block_id].clone()
