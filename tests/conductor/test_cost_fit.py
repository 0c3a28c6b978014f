"""The bounded, recency-weighted, robust non-negative fit of the prefill terms (cost_fit.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.conductor import CostModel, fit_prefill
from kvpool.conductor.cost_fit import (
    PLAIN,
    FitSettings,
    bounded_lstsq,
    design,
    fit_terms,
    recency_weights,
)
from kvpool.errors import ConfigError, InvalidArgument
from tests.conductor.busy_host import BUSY_HOST

LENGTHS = (100, 200, 300, 400, 500, 600, 700, 800)


def quadratic(base: float, linear: float, quad: float, n: int) -> float:
    return base + linear * n + quad * n * n


def test_every_term_is_bounded_by_the_samples_it_is_part_of() -> None:
    # the busy host's samples: least squares wants more of every term than the fastest
    # samples allow (base <= 0.17 s, linear <= 0.19 s / 158, quadratic <= 0.19 s / 158^2)
    fit = fit_terms(BUSY_HOST, PLAIN)
    assert fit.upper == (0.17, 0.19 / 158, 0.19 / 158 ** 2)
    assert fit.coefficients == pytest.approx(fit.upper, rel=1e-12)
    assert fit_prefill(BUSY_HOST).prefill_s(158) == pytest.approx(0.17 + 0.19 + 0.19)


def test_recent_samples_weigh_more() -> None:
    # the same lengths measured twice, 1.2x slower the second time; a half-life of 4 samples
    old = [(n, 0, quadratic(0.1, 1e-3, 1e-7, n)) for n in LENGTHS]
    new = [(n, 0, 1.2 * s) for n, _, s in old]
    samples = old + new
    fit = fit_terms(samples, FitSettings(half_life=4, outlier_k=math.inf))
    arr = np.array(samples, dtype=np.float64)
    root = np.sqrt(np.power(0.5, np.arange(15, -1, -1) / 4))
    expected = np.linalg.lstsq(design(arr) * root[:, None], arr[:, 2] * root, rcond=None)[0]
    assert fit.coefficients == pytest.approx(tuple(expected), rel=1e-9)
    assert fit.coefficients == pytest.approx((0.116, 1.16e-3, 1.16e-7), rel=1e-9)
    same = fit_terms(samples, PLAIN)  # equal weights: halfway
    assert same.coefficients == pytest.approx((0.11, 1.1e-3, 1.1e-7), rel=1e-9)
    assert recency_weights(3, 1.0).tolist() == [0.25, 0.5, 1.0]


def test_outliers_are_left_out_and_the_rest_fitted_exactly() -> None:
    samples = [(n, 0, quadratic(0.05, 2e-4, 1e-8, n)) for n in (64, 128, 256, 512, 768, 1024)]
    samples = samples * 2
    for i in (3, 8):  # two prefills that shared the host with a burner: 10x slower
        n, p, s = samples[i]
        samples[i] = (n, p, 10 * s)
    fit = fit_terms(samples)
    assert fit.coefficients == pytest.approx((0.05, 2e-4, 1e-8), rel=1e-9)
    assert (fit.num_samples, fit.num_outliers) == (12, 2)
    assert fit.residual_s == pytest.approx(0.0, abs=1e-12)
    plain = fit_terms(samples, PLAIN)  # without: pulled up to the bounds
    assert plain.num_outliers == 0 and plain.base_s > 0.06 and plain.residual_s > 0.4


def test_the_old_regime_is_left_out_once_it_disagrees_with_most_of_the_weight() -> None:
    fast = [(n, 0, quadratic(0.1, 1e-3, 1e-7, n)) for n in LENGTHS]
    slow = [(n, 0, 2 * s) for n, _, s in fast]
    fit = fit_terms(fast * 3 + slow, FitSettings(half_life=64))
    assert fit.coefficients == pytest.approx((0.1, 1e-3, 1e-7), rel=1e-9)
    assert fit.num_outliers == 8


def test_bad_samples_and_settings_are_refused() -> None:
    with pytest.raises(InvalidArgument, match="at least 3"):
        fit_terms([(10, 0, 1.0), (20, 0, 2.0)])
    for bad in ((5, 6, 1.0), (5, 0, -1.0), (5, 0, math.inf), (5, 0, math.nan)):
        with pytest.raises(InvalidArgument, match="bad sample"):
            fit_terms([(10, 0, 1.0), (20, 0, 2.0), bad])
    for kwargs in ({"half_life": 0}, {"outlier_k": -1}, {"scale_floor": -0.1},
                   {"max_rounds": 0}):
        with pytest.raises(ConfigError):
            FitSettings(**kwargs)  # type: ignore[arg-type]


def test_fit_prefill_keeps_the_other_terms() -> None:
    base = CostModel(decode_base_s=0.5)
    fitted = fit_prefill([(n, 0, 0.01 + 1e-3 * n) for n in (10, 20, 40, 80)], base)
    assert (fitted.prefill_base_s, fitted.prefill_linear_s) == pytest.approx((0.01, 1e-3))
    assert fitted.prefill_quadratic_s == pytest.approx(0.0, abs=1e-15)
    assert fitted.decode_base_s == 0.5


samples_st = st.lists(
    st.tuples(st.integers(1, 4000), st.integers(0, 4000), st.floats(1e-3, 60.0)).map(
        lambda t: (t[0], min(t[1], t[0] - 1), t[2])),
    min_size=3, max_size=30)


@settings(max_examples=60, deadline=None)
@given(samples=samples_st, seed=st.integers(0, 2**32 - 1))
def test_the_bounded_solve_is_feasible_and_beats_every_other_feasible_point(
        samples: list[tuple[int, int, float]], seed: int) -> None:
    fit = fit_terms(samples)
    x = np.array(fit.coefficients)
    upper = np.array(fit.upper)
    assert np.all(x >= 0) and np.all(x <= upper)
    arr = np.array(samples, dtype=np.float64)
    a, b = design(arr), arr[:, 2]
    w = recency_weights(len(b), 3.0)
    best = bounded_lstsq(a, b, w, upper)

    def cost(v: np.ndarray) -> float:
        return float(np.sum(w * (a @ v - b) ** 2))

    rng = np.random.default_rng(seed)
    finite = np.where(np.isfinite(upper), upper, 10 * (best + 1))
    for _ in range(50):  # anywhere in the box, and close to the solution
        far = rng.uniform(0, 1, 3) * finite
        near = np.clip(best * (1 + rng.normal(0, 0.01, 3)), 0, upper)
        assert cost(best) <= min(cost(far), cost(near)) * (1 + 1e-9) + 1e-15
