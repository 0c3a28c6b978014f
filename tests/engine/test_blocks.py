"""The block-hash chain against the formula in engine/blocks.py, computed independently
(hashlib and int.to_bytes, no numpy): the pool's keys and the conductor's prefix index rest
on these values, so a faster computation must give the same ones."""

from __future__ import annotations

import hashlib
import random

import pytest

from kvpool.engine.blocks import chain_hash, prefix_block_hashes
from kvpool.errors import InvalidArgument

MASK = (1 << 64) - 1


def formula(tokens: list[int], block_size: int, root: int) -> list[int]:
    out, parent = [], root
    for i in range(len(tokens) // block_size):
        h = hashlib.blake2b(digest_size=8, person=b"kvpool-block")
        h.update((parent & MASK).to_bytes(8, "little"))
        block = tokens[i * block_size:(i + 1) * block_size]
        h.update(b"".join(t.to_bytes(8, "little", signed=True) for t in block))
        parent = int.from_bytes(h.digest(), "little")
        out.append(parent)
    return out


def test_the_chain_is_the_formula_for_random_prompts_block_sizes_and_roots() -> None:
    rng = random.Random(11)
    for _ in range(300):
        size = rng.choice([1, 2, 3, 16, 64])
        tokens = [rng.randrange(0, 1 << 31) for _ in range(rng.randrange(0, 300))]
        root = rng.randrange(0, 1 << 64)
        want = formula(tokens, size, root)
        assert prefix_block_hashes(tokens, size, root) == want
        parents = [root, *want]
        assert [chain_hash(parents[i], tokens[i * size:(i + 1) * size])
                for i in range(len(want))] == want


def test_a_partial_block_has_no_hash_and_a_bad_block_size_is_refused() -> None:
    assert prefix_block_hashes([1, 2, 3], 4, 7) == []
    assert prefix_block_hashes(list(range(9)), 4, 7) == formula(list(range(8)), 4, 7)
    with pytest.raises(InvalidArgument, match="block_size"):
        prefix_block_hashes([1], 0, 7)


def test_a_root_over_64_bits_is_taken_modulo_as_before() -> None:
    assert prefix_block_hashes([5] * 4, 4, (1 << 64) + 9) == formula([5] * 4, 4, 9)
