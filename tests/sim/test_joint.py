"""The joint calibration (kvpool.sim.joint): the neighbourhood worked by hand, a small joint
fit end to end (in a real process too), and the shipped profile reproducing its record."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvpool.engine.emulated.profile import load_profile
from kvpool.errors import InvalidArgument
from kvpool.sim.calibrate import FitPoint, load_curves
from kvpool.sim.joint import (
    JointPoint,
    Terms,
    Workload,
    joint_fit,
    joint_profile,
    neighbour_terms,
    neighbourhood,
)
from kvpool.sim.trace import load_trace
from tests.sim.conftest import write_trace

BASE = load_profile("llama70b-8xa800")


def _point(f: float, s: float, j: float, rms1: float, rms7: float, loss: float) -> JointPoint:
    def fit(rms: float) -> FitPoint:
        return FitPoint(f, j, {}, {}, rms, loss)
    return JointPoint(Terms(f, s, j), {"fig1": fit(rms1), "fig7": fit(rms7)})


def test_the_neighbourhood_is_every_point_within_the_tolerance_on_each_curve() -> None:
    best = _point(1.0, 16, 0.005, 0.7, 0.6, 3.8)
    points = [
        _point(1.0, 16, 0.0, 0.75, 1.38, 6.2),   # fig1 +0.05, fig7 +0.78: in
        _point(0.9, 18, 0.005, 0.57, 1.10, 3.9),  # better on fig1, +0.5 on fig7: in
        _point(1.0, 14, 0.0, 1.44, 3.04, 45.7),   # fig7 +2.44: out
        _point(1.1, 16, 0.0, 1.71, 0.9, 20.0),    # fig1 +1.01: out
        best,
    ]
    near = neighbourhood(points, 1.0)
    assert near[0] is best  # best (lowest joint loss) first
    assert [p.terms for p in near] == [best.terms, Terms(0.9, 18, 0.005), Terms(1.0, 16, 0.0)]
    assert len(neighbourhood(points, 0.1)) == 1
    assert best.loss == 3.8 and best.rms("fig7") == 0.6


def _workloads(tmp_path: Path) -> list[Workload]:
    curves = load_curves()
    conv = load_trace(None, 300)
    synth = load_trace(write_trace(tmp_path / "synthetic_trace.jsonl",
                                   [(0.1 * i, 2000 + 100 * i, 30, [i]) for i in range(60)]))
    return [Workload(curves["fig1_conversation"], "conversation_trace.jsonl", conv),
            Workload(curves["fig7_synthetic"], "synthetic_trace.jsonl", synth)]


def test_a_small_joint_fit_records_each_curve_and_its_neighbourhood(tmp_path: Path) -> None:
    work = _workloads(tmp_path)
    grid = [Terms(1.0, 1.0, 0.0), Terms(1.0, 16.0, 0.005)]
    points = joint_fit(work, BASE, grid)
    assert [p.loss for p in points] == sorted(p.loss for p in points)
    prof = joint_profile(BASE, points, work, "joint-test")
    cal = prof.calibration
    assert cal is not None and cal.figure == "fig1_conversation+fig7_synthetic"
    best = points[0]
    assert (cal.decode_factor, cal.seq_factor, cal.decode_join_s) == (
        best.terms.decode_factor, best.terms.seq_factor, best.terms.decode_join_s)
    assert prof.cost.decode_per_seq_s == pytest.approx(BASE.cost.decode_per_seq_s
                                                        * best.terms.seq_factor)
    assert prof.cost.decode_base_s == pytest.approx(BASE.cost.decode_base_s)
    assert set(cal.curves) == {"fig1_conversation", "fig7_synthetic"}
    assert cal.curves["fig7_synthetic"]["share_rms_pp"] == round(best.rms("fig7_synthetic"), 3)
    assert neighbour_terms(prof)[0] == best.terms
    assert neighbour_terms(BASE) == []
    with pytest.raises(InvalidArgument):
        joint_fit(work, BASE, [])


@pytest.mark.slow
def test_joint_calibrate_in_a_real_process(tmp_path: Path) -> None:
    synth = write_trace(tmp_path / "synthetic_trace.jsonl",
                        [(0.1 * i, 2000 + 100 * i, 30, [i]) for i in range(60)])
    out = tmp_path / "joint.json"
    cmd = [sys.executable, "-m", "kvpool.cli.main", "sim", "calibrate", "--joint",
           "--limit", "200", "--synthetic-trace", str(synth), "--grid-factors", "1.0",
           "--grid-seq-factors", "1", "16", "--grid-joins-ms", "0", "--jobs", "1",
           "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    prof = load_profile(out)
    assert prof.calibration is not None and prof.calibration.seq_factor in (1.0, 16.0)
    assert "points fit both curves" in done.stderr
    missing = subprocess.run([*cmd[:-2], "--synthetic-trace", str(tmp_path / "none.jsonl")],
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "none.jsonl" in missing.stderr


@pytest.mark.slow
def test_the_shipped_joint_profile_reproduces_its_record() -> None:
    from kvpool.sim.joint import evaluate_joint
    from kvpool.sim.trace import named_trace_path

    shipped = load_profile("llama70b-8xa800-joint")
    cal = shipped.calibration
    assert cal is not None and cal.seq_factor is not None
    curves = load_curves()
    work = [Workload(curves[fig], rec["trace"], load_trace(named_trace_path(rec["trace"])))
            for fig, rec in cal.curves.items()]
    point = evaluate_joint(work, load_profile(cal.base_profile),
                           Terms(cal.decode_factor, cal.seq_factor, cal.decode_join_s))
    for fig, rec in cal.curves.items():
        assert point.rms(fig) == pytest.approx(rec["share_rms_pp"], abs=0.01)
        assert point.rms(fig) < 3.0  # the target: within 3 points RMS on both curves
