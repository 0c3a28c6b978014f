"""`kvpool sim calibrate --joint`: one set of decode terms fitted on Mooncake's conversation
(Fig.1) and synthetic (Fig.7) curves at once, written as a profile with the neighbourhood of
terms that fit both about as well (kvpool.sim.joint, docs/sim.md)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from kvpool.errors import KvpoolError

if TYPE_CHECKING:
    from kvpool.engine.emulated.profile import EngineProfile
    from kvpool.sim.joint import JointPoint

JOINT_NAME = "llama70b-8xa800-joint"


def calibrate_joint(args: argparse.Namespace) -> int:
    from kvpool.engine.emulated.profile import write_profile

    try:
        points, profile = _fit(args)
    except KvpoolError as exc:
        print(f"kvpool sim calibrate: {exc}", file=sys.stderr)
        return 2
    out = args.out or Path("out") / f"{profile.name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    write_profile(profile, out)
    if args.json:
        for p in points:
            print(json.dumps({**p.terms.as_dict(), "loss": p.loss,
                              "share_rms_pp": {fig: p.rms(fig) for fig in p.fits}}))
    _report(profile, len(points), out, args.tolerance_pp)
    return 0


def _fit(args: argparse.Namespace) -> tuple[list[JointPoint], EngineProfile]:
    """The grid's points, each fitted on both curves (printed as they come), and the profile
    of the best with its neighbourhood."""
    from kvpool.engine.emulated.profile import load_profile
    from kvpool.sim.calibrate import load_curves
    from kvpool.sim.joint import (
        FACTORS,
        JOINS_S,
        JOINT_FIGURES,
        JOINT_TRACES,
        SEQ_FACTORS,
        Workload,
        grid,
        joint_fit,
        joint_profile,
    )
    from kvpool.sim.trace import load_trace, named_trace_path

    curves = load_curves(args.curves)
    paths = {"fig1_conversation": args.trace or named_trace_path(
                 JOINT_TRACES["fig1_conversation"]),
             "fig7_synthetic": args.synthetic_trace or named_trace_path(
                 JOINT_TRACES["fig7_synthetic"])}
    workloads = [Workload(curves[fig], paths[fig].name, load_trace(paths[fig], args.limit))
                 for fig in JOINT_FIGURES]
    base = load_profile(args.base_profile)
    terms = grid(args.grid_factors or FACTORS, args.grid_seq_factors or SEQ_FACTORS,
                 [ms / 1000 for ms in args.grid_joins_ms] if args.grid_joins_ms else JOINS_S)
    points = joint_fit(workloads, base, terms, jobs=args.jobs,
                       on_point=lambda p: print(
                           f"  f={p.terms.decode_factor:.3g} s={p.terms.seq_factor:.3g} "
                           f"J={p.terms.decode_join_s * 1000:.3g} ms loss={p.loss:.1f} "
                           + " ".join(f"{fig}={p.rms(fig):.2f}pp" for fig in p.fits),
                           file=sys.stderr))
    return points, joint_profile(base, points, workloads, args.name or JOINT_NAME,
                                 args.tolerance_pp)


def _report(profile: EngineProfile, num_points: int, out: Path, tolerance_pp: float) -> None:
    """The chosen terms, each curve's residual, and the neighbourhood, on stderr."""
    cal = profile.calibration
    assert cal is not None
    print(f"{profile.name}: decode_factor {cal.decode_factor:.3g}, seq_factor "
          f"{cal.seq_factor:.3g}, decode_join_s {cal.decode_join_s * 1000:.3g} ms "
          f"({num_points} points tried); written to {out}", file=sys.stderr)
    for fig, rec in cal.curves.items():
        print(f"{fig} ({rec['trace']}): share residual (RMS) {rec['share_rms_pp']:.2f} points; "
              f"shares {rec['share_at_ms']} (paper {rec['paper_share_at_ms']}); "
              f"TBT {rec['tbt_ms']} (paper {rec['paper_tbt_ms'] or '-'})", file=sys.stderr)
    print(f"{len(cal.neighbourhood)} points fit both curves within {tolerance_pp:g} point "
          f"of the best:", file=sys.stderr)
    for n in cal.neighbourhood:
        print("  " + " ".join(f"{k}={v:g}" for k, v in n.items()), file=sys.stderr)
