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
        per_layer = num_blocks * 2 * block_size
        self._plane_starts = np.array([layer * per_layer + kind * block_size
                                       for layer in range(num_layers) for kind in (0, 1)],
                                      dtype=np.intp)
        """Row of block 0, offset 0 of each layer and kind (layer-major) among all the
        cache's token rows (`write_all`)."""
        self._word_rows = self.kv.view(np.uint64).reshape(-1, row_bytes // 8) \
            if row_bytes % 8 == 0 else None
        """Every token row of the cache as 8-byte words (`write_all`), a view made once."""
        self._words = self.kv.view(np.uint64).reshape(-1) if row_bytes == 8 else None
        """Rows of one word (the default scale's), as one flat array: a scatter of single
        words takes 20% less time than of rows that are one word wide."""

    @property
    def base_addr(self) -> int:
        return int(self.kv.ctypes.data)

    def write_all(self, block_ids: np.ndarray, offsets: np.ndarray, base: np.ndarray,
                  constants: np.ndarray) -> None:
        """Token row i of every layer and kind into block `block_ids[i]` at `offsets[i]`: in
        layer l's K (k = 0) or V (k = 1), `base[i] ^ constants[2 * l + k]` (`constants`:
        [num_layers * 2, row_bytes] uint8). A whole step's rows, every sequence of the batch,
        in one XOR and one assignment of 8-byte words over the cache's rows (an assignment
        per layer and kind, on bytes, made four times the numpy calls). Rows are whole
        words, as the emulated engine's are (`row_bytes_for`)."""
        flat = self._word_rows
        assert flat is not None, f"rows of {self.row_bytes} bytes are not whole words"
        at = block_ids * (2 * self.block_size) + offsets
        where = (self._plane_starts[:, None] + at[None, :]).ravel()
        if self._words is not None:
            words = base.view(np.uint64)[None, :, 0] ^ constants.view(np.uint64)[:, 0, None]
            self._words[where] = words.ravel()
            return
        rows = base.view(np.uint64)[None, :, :] ^ constants.view(np.uint64)[:, None, :]
        flat[where] = rows.reshape(-1, flat.shape[1])

    def rows(self, layer: int, kind: int, block_id: int, count: int) -> np.ndarray:
        """The first `count` token rows of one block's K or V (a view)."""
        return self.kv[layer, block_id, kind, :count]
