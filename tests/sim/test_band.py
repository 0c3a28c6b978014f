"""The band over the calibration's neighbourhood and the report's verdicts, by hand."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpool.engine.emulated.profile import load_profile
from kvpool.sim.experiments.band import band, band_profiles, describe, moved_by
from kvpool.sim.experiments.suite import comparisons, verdict
from kvpool.sim.joint import Terms


def test_band_is_the_best_value_and_the_range_and_names_the_term_that_moves_it() -> None:
    values = [(Terms(1.0, 16, 0.005), 300.0), (Terms(1.0, 16, 0.0), 280.0),
              (Terms(0.9, 18, 0.005), 320.0), (Terms(1.0, 14, 0.0), None)]
    b = band(values)
    assert (b["best"], b["lo"], b["hi"]) == (300.0, 280.0, 320.0)
    # means by decode_factor: 1.0 -> 290, 0.9 -> 320 (span 30); by seq_factor: 16 -> 290,
    # 18 -> 320 (30); by join: 0.005 -> 310, 0 -> 280 (30): a tie goes to the first named
    assert b["moved_by"] == "decode_factor"
    assert moved_by([(Terms(1, 16, 0.0), 1.0), (Terms(1, 16, 0.01), 9.0),
                     (Terms(1, 18, 0.0), 2.0)]) == "decode_join_s"  # 8 against 1
    assert band([(Terms(1, 1, 0), None)])["best"] is None
    assert band([(Terms(1, 1, 0), 5.0)])["moved_by"] is None  # one value moves nothing
    assert describe(b) == "+300% (+280..+320%, decode_factor)"
    assert describe({"best": None}) == "-"


def test_the_shipped_joint_profile_names_its_neighbourhood() -> None:
    prof = load_profile("llama70b-8xa800-joint")
    profiles = band_profiles(prof)
    assert profiles and profiles[0][1].cost == prof.cost  # the best fit is the profile itself
    assert all(p.chunk_overhead_s == prof.chunk_overhead_s for _, p in profiles)
    assert band_profiles(load_profile("llama70b-8xa800")) == []


@pytest.mark.parametrize(("ours", "paper", "band_", "expected"), [
    (120.0, 100.0, None, "within 25%"), (126.0, 100.0, None, "outside (higher)"),
    (70.0, 100.0, (60.0, 110.0), "inside the band"), (70.0, 100.0, (60.0, 90.0),
                                                      "outside (lower)"),
    (1.0, 3.3, None, "within 25%"),  # a share under 10%: within 2.5 points
    (0.5, 3.3, None, "outside (lower)")])
def test_verdicts(ours: float, paper: float, band_: tuple[float, float] | None,
                  expected: str) -> None:
    assert verdict(ours, paper, band_, percent=True) == expected
    assert verdict(1.0, 3.3) == "outside (lower)"  # not a share: 25% of 3.3


def test_comparisons_pair_every_field_with_its_paper_figure(tmp_path: Path) -> None:
    rows = [{"trace": "t.jsonl", "system": "mooncake", "share_at_ms": {"100": 91.0, "50": 1.0},
             "paper_share_at_ms": {"100": 96.6, "50": 3.3},
             "gain_pct_at_ms": {"100": 300.0}, "paper_gain_pct_at_ms": {"100": 498},
             "gain_band_pct_at_ms": {"100": {"best": 300.0, "lo": 250.0, "hi": 520.0}},
             "paper_best_vllm_share_at_ms": None, "ratio": 1.2, "paper_ratio": 2.0,
             "paper_name": "x"}]
    got = {(c["figure"], c["verdict"]) for c in comparisons(rows)}
    assert got == {("share_at_ms[100]", "within 25%"), ("share_at_ms[50]", "within 25%"),
                   ("gain_pct_at_ms[100]", "inside the band"), ("ratio", "outside (lower)")}
    assert all(c["row"] == "t.jsonl mooncake" for c in comparisons(rows))
