from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpool.conductor import CostModel, fit_prefill
from kvpool.errors import ConfigError, InvalidArgument


def test_default_prefill_matches_paper_figure14_within_ten_percent() -> None:
    cost = CostModel()
    # [F] Fig.14, 0% cached: 8k 1.005 s, 32k 4.478 s, 128k 27.517 s
    for n, paper in ((8192, 1.005), (32768, 4.478), (131072, 27.517)):
        assert abs(cost.prefill_s(n, 0) - paper) / paper < 0.10


def test_prefill_formula_exact() -> None:
    cost = CostModel(prefill_base_s=0.5, prefill_linear_s=0.01, prefill_quadratic_s=0.001)
    assert cost.prefill_s(100, 40) == pytest.approx(0.5 + 0.01 * 60 + 0.001 * (10000 - 1600))


def test_decode_step_and_transfer() -> None:
    cost = CostModel()
    assert cost.decode_step_s(1, 8192) == pytest.approx(0.0260 + 2.16e-4 + 3.58e-8 * 8192)
    # 320 KiB per token at 800 Gbps * 0.87 = 87 GB/s
    assert cost.kv_transfer_s(1000) == pytest.approx(327_680_000 / 87e9)
    assert cost.kv_transfer_s(0) == 0.0
    assert cost.with_bandwidth(100).kv_transfer_s(1000) == pytest.approx(327_680_000 / 10.875e9)


def test_bad_arguments_raise() -> None:
    cost = CostModel()
    with pytest.raises(InvalidArgument):
        cost.prefill_s(10, 11)
    with pytest.raises(InvalidArgument):
        cost.decode_step_s(-1, 0)
    with pytest.raises(ConfigError):
        CostModel(bandwidth_gbps=0)
    with pytest.raises(ConfigError):
        CostModel(link_efficiency=1.5)
    with pytest.raises(ConfigError):
        CostModel(prefill_linear_s=-1.0)


def test_fit_recovers_known_coefficients() -> None:
    truth = CostModel(prefill_base_s=0.2, prefill_linear_s=2e-4, prefill_quadratic_s=1e-9)
    samples = [(n, p, truth.prefill_s(n, p))
               for n in (1000, 4000, 16000, 64000) for p in (0, n // 2)]
    fitted = fit_prefill(samples)
    assert fitted.prefill_base_s == pytest.approx(0.2, rel=1e-6)
    assert fitted.prefill_linear_s == pytest.approx(2e-4, rel=1e-6)
    assert fitted.prefill_quadratic_s == pytest.approx(1e-9, rel=1e-6)
    assert fitted.decode_base_s == CostModel().decode_base_s


def test_fit_rejects_bad_samples() -> None:
    with pytest.raises(InvalidArgument):
        fit_prefill([(10, 0, 1.0), (20, 0, 2.0)])
    with pytest.raises(InvalidArgument):
        fit_prefill([(10, 0, 1.0), (20, 0, 2.0), (5, 6, 1.0)])


@given(n=st.integers(1, 200_000), a=st.integers(0, 200_000), b=st.integers(0, 200_000))
def test_a_longer_prefix_never_makes_prefill_slower(n: int, a: int, b: int) -> None:
    cost = CostModel()
    lo, hi = sorted((min(a, n), min(b, n)))
    assert cost.prefill_with_load_s(n, hi) <= cost.prefill_with_load_s(n, lo)
