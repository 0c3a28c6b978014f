"""Prefix-chained block hashes: the one key space shared by the engine, the pool and the conductor.

A prompt is cut into full blocks of `block_size` tokens; a trailing partial block has no hash.
The hash of block i covers the model's identity and every token of blocks 0..i:

    h[-1] = root                                     (identity.ModelIdentity.root)
    h[i]  = H(h[i-1] || tokens[i*B:(i+1)*B])        H = blake2b, 8-byte digest

so two prompts share h[i] exactly when they share their first (i+1)*B tokens (up to a 2**-64
collision), and two engines whose KV bytes differ (checkpoint contents, dtype, KV layout; the
root digests all of them) never share a key. The conductor's `PrefixIndex` takes these ints as
they are; the store keys an object by `block_key(h)`.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

from kvpool.errors import InvalidArgument

_MASK = (1 << 64) - 1


def model_hash(identity: str) -> int:
    """A chain root from a canonical description of what decides the KV bytes
    (`identity.ModelIdentity.root` passes its JSON)."""
    digest = hashlib.blake2b(identity.encode(), digest_size=8, person=b"kvpool-model").digest()
    return int.from_bytes(digest, "little")


def salted_root(root: int, salt: str | None) -> int:
    """The chain root of a request with a cache salt: its blocks' hashes (and so its pool
    keys and prefix hits) are shared only with requests of the same model and salt."""
    if not salt:
        return root
    h = hashlib.blake2b(digest_size=8, person=b"kvpool-salt")
    h.update((root & _MASK).to_bytes(8, "little"))
    h.update(salt.encode("utf-8", "surrogatepass"))
    return int.from_bytes(h.digest(), "little")


_BLOCK_HASH = hashlib.blake2b(digest_size=8, person=b"kvpool-block")
"""The block hash's initial state, copied per block (cheaper than setting its parameters)."""


def chain_hash(parent: int, tokens: Sequence[int]) -> int:
    """The hash of one full block given its parent's hash."""
    return _chained(parent, _int64s(tokens))


def _int64s(tokens: Sequence[int]) -> bytes:
    """Tokens as little-endian int64s, the chain's form of a block (struct from a list: 2.5x
    numpy's way)."""
    return struct.pack(f"<{len(tokens)}q", *tokens)


def _chained(parent: int, block: bytes | memoryview) -> int:
    """H(parent || block): `block` is the block's tokens as little-endian int64s."""
    h = _BLOCK_HASH.copy()
    h.update((parent & _MASK).to_bytes(8, "little"))
    h.update(block)
    return int.from_bytes(h.digest(), "little")


def prefix_block_hashes(token_ids: Sequence[int], block_size: int, root: int) -> list[int]:
    """One hash per full block of `token_ids`, each chained on the one before it. The tokens
    are made bytes once, not once per block (a long prompt's chain is on the proxy's path of
    every request: about 1.5x faster from 2,048 tokens on, docs/serve.md)."""
    if block_size <= 0:
        raise InvalidArgument(f"block_size must be positive, got {block_size}")
    n = len(token_ids) // block_size * block_size
    if not n:
        return []
    data = memoryview(_int64s(token_ids[:n]))
    step = block_size * 8
    hashes: list[int] = []
    parent = root
    for start in range(0, n * 8, step):
        parent = _chained(parent, data[start:start + step])
        hashes.append(parent)
    return hashes


def block_key(block_hash: int, layer: int | None = None) -> str:
    """The store key of a block's KV (all layers, or one layer when `layer` is given)."""
    base = f"kv/{block_hash & _MASK:016x}"
    return base if layer is None else f"{base}/L{layer}"


def request_key(request_id: str, layer: int | None = None) -> str:
    """The store key of a request's last, partial block (all layers, or one layer): written by
    the prefill worker, read and removed by the decode worker."""
    digest = hashlib.blake2b(request_id.encode(), digest_size=16, person=b"kvpool-req").hexdigest()
    base = f"kvreq/{digest}"
    return base if layer is None else f"{base}/L{layer}"
