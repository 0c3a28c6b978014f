"""The block manager's mechanism, with exact block ids."""

from __future__ import annotations

from kvpool.engine.block_manager import BlockManager
from kvpool.engine.config import SamplingParams
from kvpool.engine.sequence import Sequence


def seq(tokens: list[int], rid: str = "r") -> Sequence:
    return Sequence(rid, list(tokens), len(tokens), SamplingParams(), block_size=4, root_hash=9)


def test_allocate_hit_free_and_lru() -> None:
    bm = BlockManager(num_blocks=6, block_size=4)
    a = seq(list(range(10)))
    assert bm.match_prefix(a) == [] and bm.can_allocate(a, [])
    bm.allocate(a, [])
    assert a.block_table == [0, 1, 2]
    a.num_computed_tokens = 10
    bm.commit(a)
    assert a.num_committed_blocks == 2 and len(bm.cached_hashes()) == 2
    bm.check_integrity()

    b = seq(list(range(8)) + [99, 98], "b")
    hits = bm.match_prefix(b)
    assert hits == [0, 1]
    bm.allocate(b, hits)
    assert b.block_table == [0, 1, 3] and b.num_cached_tokens == 8
    assert bm.blocks[0].ref_count == 2
    bm.free(a)
    bm.free(b)
    bm.check_integrity()
    # freed in reverse order: partial blocks first, then the deepest prefix block
    assert list(bm._free) == [4, 5, 2, 3, 1, 0]
    c = seq(list(range(12)), "c")  # 3 full blocks; a hit may cover at most 11 tokens
    assert bm.match_prefix(c) == [0, 1]


def test_collision_is_a_miss() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    a = seq([1, 2, 3, 4, 5])
    bm.allocate(a, [])
    a.num_computed_tokens = 5
    bm.commit(a)
    b = seq([9, 9, 9, 9, 5])
    b.block_hashes = list(a.block_hashes)  # forge a collision
    assert bm.match_prefix(b) == []


def test_reusing_a_cached_free_block_drops_its_hash() -> None:
    bm = BlockManager(num_blocks=2, block_size=4)
    a = seq([1, 2, 3, 4, 5])
    bm.allocate(a, [])
    a.num_computed_tokens = 5
    bm.commit(a)
    bm.free(a)
    assert bm.cached_hashes() == a.block_hashes
    bm.allocate_blocks(2)
    assert bm.cached_hashes() == [] and bm.num_free_blocks == 0
    bm.check_integrity()
