"""The learned cost model kept within what was measured (measured.py), and admission refusing
as unreachable only by measurements (admission.py, `judged`)."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.conductor import (
    Accepted,
    Conductor,
    ConductorConfig,
    CostModel,
    Rejected,
    RequestInfo,
    fit_prefill,
)
from kvpool.conductor.cost import load_cost_model
from kvpool.conductor.cost_fit import PLAIN
from kvpool.conductor.measured import PROVEN_BY, MeasuredCostModel, cost_note, learn_prefill
from tests.conductor.busy_host import BUSY_HOST
from tests.conductor.conftest import SIMPLE_COST, view_with


def test_the_busy_host_prediction_stays_within_what_was_measured() -> None:
    model = learn_prefill(BUSY_HOST, CostModel())
    # the fit: every term at the bound the fastest samples set (see test_cost_fit)
    assert (model.prefill_base_s, model.prefill_linear_s, model.prefill_quadratic_s) == \
        pytest.approx((0.17, 0.19 / 158, 0.19 / 158 ** 2), rel=1e-12)
    assert model.fit is not None and model.fit.num_samples == 24
    assert model.longest_context == 185
    # 158 tokens: 0.17 + 0.19 + 0.19 s, under the 1.6 s measured for 158 tokens and more
    assert model.prefill_s(158) == pytest.approx(0.55)
    assert model.envelope_s(158) == 1.6 and model.envelope_s(186) == math.inf
    # 1,500 tokens: beyond 185 the attention term grows linearly, not with n^2
    at_1500 = 0.17 + 0.19 / 158 * 1500 + 0.19 / 158 ** 2 * 1500 * 185
    assert model.prefill_s(1500) == pytest.approx(at_1500) == pytest.approx(4.0858, abs=1e-4)
    assert fit_clip_free(1500) == pytest.approx(0.17 + 0.19 / 158 * 1500 + 0.19 * (1500 / 158) ** 2)
    # what the measurements prove: the third longest of the samples no larger
    assert model.proven_prefill_s(1500) == 1.38 and model.proven_prefill_s(150) == 0.17
    assert model.proven_prefill_s(100) == 0.0  # nothing that short was measured
    assert model.to_dict() == replace(CostModel(), prefill_base_s=model.prefill_base_s,
                                      prefill_linear_s=model.prefill_linear_s,
                                      prefill_quadratic_s=model.prefill_quadratic_s).to_dict()


def fit_clip_free(n: int) -> float:
    """The same coefficients without the linear tail: what `kvpool sim fit` writes."""
    return fit_prefill(BUSY_HOST).prefill_s(n)


def test_its_json_is_a_plain_cost_model(tmp_path: Path) -> None:
    model = learn_prefill(BUSY_HOST, CostModel(decode_base_s=0.5))
    path = tmp_path / "cost.json"
    path.write_text(json.dumps(model.to_dict()))
    back = load_cost_model(path)
    assert type(back) is CostModel and back.decode_base_s == 0.5
    assert back.prefill_base_s == model.prefill_base_s


def test_the_cost_note_says_which_model_predicted_what() -> None:
    model = learn_prefill(BUSY_HOST, CostModel())
    note = cost_note(model, "fitted", 1500, 0)
    assert note.startswith("cost=fitted base=0.17s linear=0.001203s/tok ")
    assert "residual=" in note and "samples=24 outliers=0 longest=185 prefill=4.086s" in note
    assert note.endswith(" fitted=4.086s envelope=- proven=1.380s")
    assert cost_note(CostModel(), "default", 1000, 0) == (
        "cost=default base=0.156s linear=0.0001066s/tok quadratic=7.81e-10s/tok2 "
        "prefill=0.263s")


samples_st = st.lists(
    st.tuples(st.integers(1, 3000), st.integers(0, 3000), st.floats(1e-3, 60.0)).map(
        lambda t: (t[0], min(t[1], t[0]), t[2])),
    min_size=3, max_size=24)


@settings(max_examples=80, deadline=None)
@given(samples=samples_st, n=st.integers(1, 6000), p=st.integers(0, 6000),
       robust=st.booleans())
def test_the_estimate_never_exceeds_the_measured_envelope(
        samples: list[tuple[int, int, float]], n: int, p: int, robust: bool) -> None:
    p = min(p, n)
    model = learn_prefill(samples, SIMPLE_COST, *(() if robust else (PLAIN,)))
    assert model.fit is not None
    coefs = (model.prefill_base_s, model.prefill_linear_s, model.prefill_quadratic_s)
    assert all(0 <= c <= u for c, u in zip(coefs, model.fit.upper, strict=True))
    larger = [s for sn, sp, s in samples
              if sn - sp >= n - p and sn * sn - sp * sp >= n * n - p * p]
    est = model.prefill_with_load_s(n, p)
    assert est >= 0 and model.proven_prefill_s(n, p) <= est
    if larger:
        assert est <= max(larger) and model.prefill_s(n, p) <= max(larger)
    # more prompt never costs less, a longer reused prefix never costs more
    assert model.prefill_with_load_s(n + 1, p) >= est
    if p < n:
        assert model.prefill_with_load_s(n, p + 1) <= est


# -- admission: refused as unreachable only by measurements ------------------------------

def conductor(cost: CostModel, ttft_slo_s: float = 5.0) -> Conductor:
    cfg = ConductorConfig(prefill_policy="cache_aware", admission="early_rejection_predicted",
                          ttft_slo_s=ttft_slo_s, tbt_slo_s=1.0)
    return Conductor(cfg, cost)


def request(input_len: int) -> RequestInfo:
    return RequestInfo(1, input_len, 4, ())


def measured(times: dict[int, float]) -> MeasuredCostModel:
    """1 ms per token up to the longest sample, then 10 ms per token past it (a steep fit), with
    the given measured times."""
    rows = tuple((n, 0, s) for n, s in times.items())
    return MeasuredCostModel(**SIMPLE_COST.to_dict(), measured=rows,
                             longest_context=max(times))


def test_an_unproven_extrapolation_over_the_limit_waits_for_an_idle_instance() -> None:
    model = replace(measured({100: 0.1, 200: 0.2, 400: 0.4}), prefill_linear_s=0.02)
    assert model.prefill_s(1000) == pytest.approx(20.0)  # predicted, over the 5 s limit
    assert model.proven_prefill_s(1000) == 0.1  # the measurements prove 0.1 s
    view = view_with({}, num_prefill=1, num_decode=1)
    assert isinstance(conductor(model).schedule(request(1000), view, 0.0), Accepted)
    view.prefill[0].busy_until_s = 2.0  # a queue: refused, but as a wait (predicted 2 + 5 s)
    r = conductor(model).schedule(request(1000), view, 0.0)
    assert isinstance(r, Rejected) and r.reason == "ttft"
    assert (r.unloaded_ttft_s, r.ttft_limit_s, r.predicted_ttft_s) == (5.0, 5.0, 7.0)
    # the papers' model, given as it is, is believed: its prediction alone refuses
    fixed = replace(SIMPLE_COST, prefill_linear_s=0.02)
    r = conductor(fixed).schedule(request(1000), view_with({}, 1, 1), 0.0)
    assert isinstance(r, Rejected) and r.unloaded_ttft_s == pytest.approx(20.0)


def test_measurements_over_the_limit_refuse_as_unreachable() -> None:
    slow = {100: 6.0, 120: 7.0, 140: 8.0, 160: 9.0}  # PROVEN_BY of them over the 5 s limit
    model = replace(measured(slow), prefill_linear_s=0.1)
    r = conductor(model).schedule(request(1000), view_with({}, 1, 1), 0.0)
    assert PROVEN_BY == 3 and model.proven_prefill_s(1000) == 7.0
    assert isinstance(r, Rejected) and r.unloaded_ttft_s == 7.0 > r.ttft_limit_s
    two = replace(measured({100: 6.0, 120: 7.0, 140: 0.1}), prefill_linear_s=0.1)
    assert two.proven_prefill_s(1000) == 0.1  # two slow ones may be a busy host
    assert isinstance(conductor(two).schedule(request(1000), view_with({}, 1, 1), 0.0),
                      Accepted)


def test_the_relative_objective_is_untouched() -> None:
    model = replace(measured({100: 0.1, 200: 0.2, 400: 0.4}), prefill_linear_s=0.02)
    cfg = ConductorConfig(prefill_policy="cache_aware", ttft_slo_relative=2.0, tbt_slo_s=1.0)
    view = view_with({}, num_prefill=1, num_decode=1)
    view.prefill[0].busy_until_s = 25.0  # 25 s queue + 20 s > 2 x 20 s
    r = Conductor(cfg, model).schedule(request(1000), view, 0.0)
    assert isinstance(r, Rejected) and r.predicted_ttft_s == pytest.approx(45.0)
