"""The emulated engine's KV: a byte buffer in the layout of `kv_layout.KVLayout`,

    kv [num_layers, num_blocks, 2, block_size, row_bytes]  uint8

registered with the transfer engine as the torch cache is, so the pool and pushes move these
bytes exactly as they move real KV. numpy zeros are mapped lazily: only blocks that are used
take memory.
"""

from __future__ import annotations

import numpy as np

from kvpool.engine.kv_layout import KVLayout


class ByteKVCache(KVLayout):
    kv: np.ndarray

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, row_bytes: int) -> None:
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.row_bytes = row_bytes
        self.kv = np.zeros((num_layers, num_blocks, 2, block_size, row_bytes), dtype=np.uint8)
        self.block_bytes = block_size * row_bytes

    @property
    def base_addr(self) -> int:
        return int(self.kv.ctypes.data)

    def write(self, layer: int, kind: int, block_ids: np.ndarray, offsets: np.ndarray,
              rows: np.ndarray) -> None:
        """Token row i of `rows` into block `block_ids[i]` at `offsets[i]`, in one assignment
        (a whole step's rows, every sequence of the batch)."""
        self.kv[layer, block_ids, kind, offsets] = rows

    def rows(self, layer: int, kind: int, block_id: int, count: int) -> np.ndarray:
        """The first `count` token rows of one block's K or V (a view)."""
        return self.kv[layer, block_id, kind, :count]
