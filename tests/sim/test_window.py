"""The representative window of a trace, worked by hand."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpool.errors import InvalidArgument
from kvpool.sim.window import describe, rates, representative_window
from tests.sim.conftest import trace_of


def test_the_window_with_the_whole_traces_rates_is_picked(tmp_path: Path) -> None:
    rows = [(0.0, 100, 10, [1]),
            (10.0, 100, 10, [2]), (15.0, 100, 10, [3]),
            (20.0, 400, 40, [4]), (40.0, 100, 10, [5])]
    reqs = trace_of(tmp_path, rows)
    # whole trace: 5 requests, 800 prompt and 80 output tokens over 40 s:
    # 0.125 req/s, 20 and 2 tokens/s
    whole = rates(reqs, 40.0)
    assert (whole.requests_per_s, whole.prompt_tokens_per_s) == (0.125, 20.0)
    w = representative_window(reqs, 16.0, step_s=2.0)
    # [0, 16): 3 requests, 300 in -> 0.1875 req/s (+50%); [2, 18) .. [8, 24) hold the
    # requests at 10 and 15 s (from 6 s on also the one at 20 s: 600 in, +50% req/s):
    # [2, 18): 0.125 req/s, 12.5 and 1.25 tokens/s (-37.5%); later windows hold 2-3 requests
    # and deviate as much or more. The earliest of the best wins.
    assert w.start_s == 2.0 and w.deviation == pytest.approx(0.375)
    assert "largest deviation 37.5%" in describe(w)


def test_a_window_needs_requests_and_a_length(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument):
        representative_window([], 10.0)
    reqs = trace_of(tmp_path, [(0.0, 100, 10, [1])])
    with pytest.raises(InvalidArgument):
        representative_window(reqs, 0.0)
    assert representative_window(reqs, 50.0).start_s == 0.0  # longer than the trace: one
