"""Where each block's KV lives in one contiguous buffer: the address arithmetic that the pool
connector and pushes use, shared by the torch cache (`kv_cache.KVCache`) and the emulated
engine's byte buffer (`emulated.cache.ByteKVCache`). No torch here.

    buffer [num_layers, num_blocks, 2, block_size, row bytes]
            layer      block      K|V token in block

so the K (or V) of one block of one layer is `block_bytes` contiguous bytes at
`addr(layer, kind, block)`, and its V follows its K.
"""

from __future__ import annotations

K, V = 0, 1


class KVLayout:
    """Subclasses set `num_layers`, `num_blocks`, `block_size`, `block_bytes`, and `kv` (the
    object registered with the transfer engine), and define `base_addr` and `num_bytes`."""

    num_layers: int
    num_blocks: int
    block_size: int
    block_bytes: int
    kv: object

    @property
    def base_addr(self) -> int:
        raise NotImplementedError

    @property
    def num_bytes(self) -> int:
        return 2 * self.num_layers * self.num_blocks * self.block_bytes

    @property
    def token_bytes(self) -> int:
        """KV bytes of one token over every layer, K and V."""
        return 2 * self.num_layers * self.block_bytes // self.block_size

    def addr(self, layer: int, kind: int, block_id: int) -> int:
        return self.base_addr + ((layer * self.num_blocks + block_id) * 2 + kind) * self.block_bytes

    def layer_part(self, block_id: int, layer: int) -> tuple[int, int]:
        """(addr, bytes) of one block's K then V in one layer: one contiguous range."""
        return self.addr(layer, K, block_id), 2 * self.block_bytes

    def block_parts(self, block_id: int) -> list[tuple[int, int]]:
        """(addr, bytes) of K then V for each layer: one block's KV as scattered parts."""
        return [(self.addr(layer, kind, block_id), self.block_bytes)
                for layer in range(self.num_layers) for kind in (K, V)]
