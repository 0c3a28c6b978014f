"""`kvpool sim calibrate`: the paper's curves as read, the loss worked by hand, a small fit
end to end (in a real process too), and the profile it writes read back."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvpool.engine.emulated.profile import load_profile
from kvpool.errors import InvalidArgument
from kvpool.sim.calibrate import (
    PaperCurve,
    calibrated_profile,
    curve_for,
    figure_for_trace,
    fit,
    load_curves,
    score,
    with_decode_terms,
)
from kvpool.sim.trace import load_trace

BASE = load_profile("llama70b-8xa800")


def test_the_packaged_curves_are_the_papers() -> None:
    curves = load_curves()
    fig1 = curves["fig1_conversation"]
    assert fig1.share_at_ms["100"] == 96.6 and fig1.share_at_ms["50"] == 3.3
    assert fig1.tbt_ms == {"p10": 57, "p50": 74, "p90": 93}
    assert curves["fig6_toolagent"].tbt_ms == {}
    assert list(curves["fig7_synthetic"].share_at_ms) == ["50", "100", "150", "200", "300",
                                                          "500", "1000"]


def test_a_trace_names_its_figure(tmp_path: Path) -> None:
    assert figure_for_trace(None) == "fig1_conversation"
    assert figure_for_trace(Path("toolagent_trace.jsonl")) == "fig6_toolagent"
    assert figure_for_trace(Path("synthetic_trace.jsonl")) == "fig7_synthetic"
    assert figure_for_trace(Path("mine.jsonl")) is None
    assert curve_for(Path("mine.jsonl")) is None
    with pytest.raises(InvalidArgument, match="unknown figure"):
        curve_for(None, "fig9")
    bad = tmp_path / "curves.json"
    bad.write_text('{"figures": {"x": {}}}')
    with pytest.raises(InvalidArgument, match="cannot read"):
        load_curves(bad)


def test_score_by_hand() -> None:
    curve = PaperCurve("f", "w", {"50": 10.0, "100": 90.0}, {"p50": 50.0})
    rms, loss = score({"50": 13.0, "100": 86.0}, {"p50": 55.0}, curve)
    assert rms == pytest.approx((25 / 2) ** 0.5)       # errors 3 and -4 points
    assert loss == pytest.approx((9 + 16 + 100) / 3)   # and +10% on the median


def test_decode_terms_scale_every_decode_coefficient_only() -> None:
    p = with_decode_terms(BASE, 2.0, 0.03)
    assert p.cost.decode_base_s == pytest.approx(2 * BASE.cost.decode_base_s)
    assert p.cost.decode_per_seq_s == pytest.approx(2 * BASE.cost.decode_per_seq_s)
    assert p.cost.decode_per_token_s == pytest.approx(2 * BASE.cost.decode_per_token_s)
    assert p.cost.decode_join_s == 0.03
    assert p.cost.prefill_s(8192, 1024) == BASE.cost.prefill_s(8192, 1024)
    with pytest.raises(InvalidArgument):
        with_decode_terms(BASE, 0.0, 0.0)


def test_a_small_fit_orders_its_points_and_writes_its_record(tmp_path: Path) -> None:
    reqs = load_trace(None, 400)
    curve = load_curves()["fig1_conversation"]
    points = fit(reqs, BASE, curve, (1.0, 2.0), (0.0, 0.04), refine=False)
    assert len(points) == 4 and [p.loss for p in points] == sorted(p.loss for p in points)
    # the microbenchmark's step alone (f=1, no join) is far below the paper's median TBT
    plain = next(p for p in points if p.decode_factor == 1.0 and p.decode_join_s == 0.0)
    assert plain.tbt_ms["p50"] < 40 < curve.tbt_ms["p50"] and plain is not points[0]
    prof = calibrated_profile(BASE, points[0], curve, "conversation_trace.jsonl")
    path = tmp_path / "p.json"
    path.write_text(json.dumps(prof.to_dict()))
    back = load_profile(path)
    assert back == prof and back.calibration is not None
    assert back.calibration.decode_factor == points[0].decode_factor
    assert back.calibration.paper_share_at_ms == curve.share_at_ms


def test_calibrate_in_a_real_process(tmp_path: Path) -> None:
    out = tmp_path / "fit.json"
    cmd = [sys.executable, "-m", "kvpool.cli.main", "sim", "calibrate", "--limit", "300",
           "--factors", "1.4", "1.6", "--joins-ms", "0", "10", "--no-refine", "--jobs", "2",
           "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    prof = load_profile(out)
    assert prof.name == "llama70b-8xa800-conversation" and prof.calibration is not None
    assert prof.calibration.decode_factor in (1.4, 1.6)
    assert "share residual" in done.stderr
    other = tmp_path / "mine.jsonl"
    other.write_text('{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [1]}\n')
    bad = subprocess.run([*cmd[:5], "--trace", str(other)], capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and "--figure" in bad.stderr


def test_the_shipped_profile_records_its_fit() -> None:
    prof = load_profile("llama70b-8xa800-conversation")
    cal = prof.calibration
    assert cal is not None and cal.base_profile == "llama70b-8xa800"
    assert prof.cost.decode_base_s == pytest.approx(BASE.cost.decode_base_s * cal.decode_factor)
    assert prof.cost.decode_join_s == cal.decode_join_s
    assert cal.share_rms_pp < 3.0
