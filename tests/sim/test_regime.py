"""The overload experiment's derived regimes, on numbers small enough to check by hand."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvpool.errors import InvalidArgument
from kvpool.sim.experiments import regime
from kvpool.sim.trace import TraceRequest
from tests.sim.conftest import SIMPLE_COST

REQS = [TraceRequest(0, 0.0, 1024, 11, (1, 2)), TraceRequest(1, 10.0, 1024, 21, (1, 3))]
COST = replace(SIMPLE_COST, decode_per_seq_s=0.001)


def test_trace_load_by_hand() -> None:
    load = regime.trace_load(REQS, SIMPLE_COST)
    assert load.span_s == 10.0
    assert load.output_tokens_per_s == pytest.approx(3.0)  # (10 + 20) decode tokens / 10 s
    assert load.mean_context == pytest.approx((10 * 1029.5 + 20 * 1034.5) / 30)
    assert load.prefill_s_per_s == pytest.approx((1.024 + 0.512) / 10)  # r1 reuses block 1
    assert (load.mean_input, load.mean_output) == (1024, 16)


def test_matched_speed_and_slos() -> None:
    load = regime.trace_load(REQS, SIMPLE_COST)
    assert regime.matched_speed(load) == pytest.approx(2 * 23_608 * 181 / 3600 / 3.0)
    assert regime.matched_slos(load, SIMPLE_COST) == pytest.approx((10.24, 0.05))


def test_decode_horizon_is_mean_output_times_the_operating_step() -> None:
    load = regime.trace_load(REQS, COST)
    # batch b = rate * step(b): b = 3 * 0.01 / (1 - 3 * 0.001); t_d = 16 * step(b)
    batch = 0.03 / 0.997
    assert regime.decode_horizon_s(load, COST, 1, 1.0) == pytest.approx(
        16 * (0.01 + 0.001 * batch))


def test_impossible_inputs_are_refused() -> None:
    with pytest.raises(InvalidArgument):
        regime.trace_load(REQS[:1], SIMPLE_COST)
    with pytest.raises(InvalidArgument):
        regime.trace_load([REQS[0], replace(REQS[1], arrival_s=0.0)], SIMPLE_COST)



def test_an_unsustainable_rate_runs_at_the_batch_that_fills_the_vram() -> None:
    load = regime.trace_load(REQS, COST)
    # 3000 tok/s at 1 ms per sequence: no batch sustains it; the queue grows until the VRAM
    # (10,000 tokens here) holds as many requests as fit at their mean context + half output
    full = 10_000 / (load.mean_context + 16 / 2)
    assert regime.decode_horizon_s(load, COST, 1, 1000.0, kv_capacity_tokens=10_000) == (
        pytest.approx(16 * (0.01 + 0.001 * full)))
    # a sustainable rate whose batch would not fit is capped the same way
    assert regime.decode_horizon_s(load, COST, 1, 1.0, kv_capacity_tokens=1) == pytest.approx(
        16 * (0.01 + 0.001 * 1 / (load.mean_context + 8)))
