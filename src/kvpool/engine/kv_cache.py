"""The KV tensor pool of the torch engine: one contiguous tensor holds every layer's K and V,

    kv [num_layers, num_blocks, 2, block_size, num_kv_heads, head_dim]
         layer      block      K|V token in block

laid out as `kv_layout.KVLayout` describes, so the pool's per-layer object of a block (K then V)
is one contiguous range, `layer_part(block, layer)`, and one gather of a layer's blocks fetches
K and V together. The whole tensor is registered once with the transfer engine, which lets the
pool (puts and gets) and pushes move blocks without copies.
"""

from __future__ import annotations

import torch

from kvpool.engine.config import EngineConfig, ModelConfig
from kvpool.engine.kv_layout import K, KVLayout, V

__all__ = ["K", "V", "KVCache"]


class KVCache(KVLayout):
    kv: torch.Tensor

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

    def block(self, block_id: int) -> torch.Tensor:
        """A copy of one block's KV for all layers: [num_layers, 2, block_size, nkv, D]."""
        return self.kv[:, block_id].clone()
