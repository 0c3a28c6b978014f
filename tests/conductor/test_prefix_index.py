from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.conductor import PrefixIndex
from kvpool.errors import InvalidArgument


def test_match_reports_leading_run_per_instance() -> None:
    idx = PrefixIndex()
    for b in (1, 2, 3):
        idx.add(0, b)
    for b in (1, 2, 3, 4):
        idx.add(1, b)
    idx.add(2, 2)  # holds a later block without the first: no prefix
    m = idx.match([1, 2, 3, 4, 5])
    assert m.lens == {0: 3, 1: 4}
    assert (m.best_blocks, m.best_instance) == (4, 1)
    assert m.blocks_on(2) == 0


def test_match_ties_go_to_lowest_id_and_empty_cases() -> None:
    idx = PrefixIndex()
    for inst in (3, 1):
        idx.add(inst, 7)
    m = idx.match([7, 8])
    assert (m.best_blocks, m.best_instance) == (1, 1)
    assert idx.match([]).best_instance is None
    assert idx.match([99]).lens == {}


def test_remove_and_misuse() -> None:
    idx = PrefixIndex()
    idx.add(0, 5)
    idx.remove(0, 5)
    assert len(idx) == 0
    assert idx.match([5]).best_blocks == 0
    with pytest.raises(InvalidArgument):
        idx.remove(0, 5)


def test_ids_are_checked_and_holders_are_the_ids() -> None:
    idx = PrefixIndex()
    with pytest.raises(InvalidArgument, match="negative"):
        idx.add(-1, 5)
    idx.add(100, 5)  # any non-negative id
    idx.add(3, 5)
    assert idx.holders(5) == {3, 100} and idx.holders(6) == frozenset()
    with pytest.raises(InvalidArgument):
        idx.remove(4, 5)  # others hold it, not this one
    with pytest.raises(InvalidArgument):
        idx.remove(-1, 5)
    idx.remove(100, 5)
    assert idx.holders(5) == {3} and len(idx) == 1


def _reference_match(held: dict[int, set[int]], blocks: list[int]) -> dict[int, int]:
    """Each instance's leading run of `blocks`, counted one instance at a time."""
    instances = set().union(*held.values()) if held else set()
    lens = {}
    for inst in instances:
        n = 0
        while n < len(blocks) and inst in held.get(blocks[n], set()):
            n += 1
        if n:
            lens[inst] = n
    return lens


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("arm"), st.integers(0, 9), st.integers(0, 7)),
                max_size=80),
       st.lists(st.integers(0, 7), max_size=10))
def test_the_index_matches_a_set_per_block_model(ops: list[tuple[str, int, int]],
                                                 blocks: list[int]) -> None:
    idx, held = PrefixIndex(), {}  # held: the reference, a set of instances per block
    for op, inst, block in ops:
        if op == "a":
            idx.add(inst, block)
            held.setdefault(block, set()).add(inst)
        elif op == "r":
            if inst in held.get(block, set()):
                idx.remove(inst, block)
                held[block].discard(inst)
                if not held[block]:
                    del held[block]
            else:
                with pytest.raises(InvalidArgument):
                    idx.remove(inst, block)
        else:
            expected = _reference_match(held, blocks)
            m = idx.match(blocks)
            assert m.lens == expected
            best = max(expected.values(), default=0)
            assert m.best_blocks == best
            assert m.best_instance == (min(i for i, n in expected.items() if n == best)
                                       if expected else None)
        assert len(idx) == len(held)
        assert all(idx.holders(b) == insts for b, insts in held.items())
