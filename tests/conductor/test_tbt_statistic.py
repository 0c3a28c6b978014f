"""The TBT statistic admission predicts: the step plus the join stalls in a request's longest
10% of gaps, worked by hand; and the join rate a decode instance's view measures."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvpool.conductor.decode import tbt_statistic_s
from kvpool.conductor.types import RequestInfo
from kvpool.conductor.view import JOIN_WINDOW_S, ClusterView
from tests.conductor.conftest import SIMPLE_COST

JOINING = replace(SIMPLE_COST, decode_join_s=0.05)


def test_free_joins_leave_the_step() -> None:
    assert tbt_statistic_s(SIMPLE_COST, 0.03, 101, 5.0) == 0.03


def test_joins_fill_the_longest_gaps_up_to_their_share() -> None:
    # 100 gaps of 20 ms: life 2 s; 10% = 10 gaps. 2 joins/s -> 4 join steps in the top 10
    assert tbt_statistic_s(JOINING, 0.02, 101, 2.0) == pytest.approx(0.02 + 0.05 * 4 / 10)
    # 50 joins/s -> 100 join steps: every one of the top 10 gaps is a join step
    assert tbt_statistic_s(JOINING, 0.02, 101, 50.0) == pytest.approx(0.07)
    # a one-token request has one gap, the longest
    assert tbt_statistic_s(JOINING, 0.02, 1, 0.0) == pytest.approx(0.02)


def test_the_view_measures_joins_over_its_window() -> None:
    view = ClusterView.create(1, 1, 1_000_000)
    for i, t in enumerate((0.0, 1.0, 2.0)):
        view.record_decode_start(0, RequestInfo(i, 100, 10, ()), t)
    assert view.decode[0].join_rate() == pytest.approx(3 / JOIN_WINDOW_S)
    view.record_decode_start(0, RequestInfo(3, 100, 10, ()), JOIN_WINDOW_S + 1.5)
    assert view.decode[0].join_rate() == pytest.approx(2 / JOIN_WINDOW_S)  # 0 and 1 left
