from __future__ import annotations

import pytest

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
