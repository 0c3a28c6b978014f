"""`kvpool sim calibrate`: fit the decode terms on Mooncake's own TBT curve and write the
profile the experiments (and the emulated engine) read (kvpool.sim.calibrate, docs/sim.md)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvpool.errors import KvpoolError

FACTOR_STEP = 0.2
JOIN_STEP_S = 0.01


def add_calibrate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("calibrate", help="fit the decode terms to Mooncake's measured TBT curve")
    p.add_argument("--trace", type=Path, default=None,
                   help="Mooncake-format JSONL (default: the conversation trace)")
    p.add_argument("--figure", default=None,
                   help="paper figure to fit (fig1_conversation, fig6_toolagent, "
                        "fig7_synthetic; default: the trace's workload)")
    p.add_argument("--curves", type=Path, default=None,
                   help="the paper's curves JSON (default: the packaged copy)")
    p.add_argument("--base-profile", default="llama70b-8xa800",
                   help="profile whose decode terms are scaled (name or file)")
    p.add_argument("--limit", type=int, default=None, help="use only the first N requests")
    p.add_argument("--factors", type=float, nargs=2, default=(1.0, 2.4), metavar=("LO", "HI"),
                   help="range of decode_factor on the coarse grid (step 0.2)")
    p.add_argument("--joins-ms", type=float, nargs=2, default=(0.0, 60.0), metavar=("LO", "HI"),
                   help="range of decode_join_s in ms on the coarse grid (step 10 ms)")
    p.add_argument("--no-refine", action="store_true", help="coarse grid only")
    p.add_argument("--jobs", type=int, default=2, help="simulations run in parallel")
    p.add_argument("--name", default=None, help="profile name (default: BASE-WORKLOAD)")
    p.add_argument("--out", type=Path, default=None,
                   help="write the profile here (default: out/NAME.json)")
    p.add_argument("--json", action="store_true", help="print every grid point as JSON")
    p.add_argument("--joint", action="store_true",
                   help="fit one set of terms on Fig.1 (conversation) and Fig.7 (synthetic) "
                        "at once, with the neighbourhood the experiments' bands run over")
    p.add_argument("--synthetic-trace", type=Path, default=None,
                   help="with --joint: the synthetic trace (default: synthetic_trace.jsonl "
                        "beside the conversation trace's directory, ../shared/data/traces/)")
    p.add_argument("--grid-factors", type=float, nargs="+", default=None, metavar="F",
                   help="with --joint: decode_factor values (default 0.8 0.9 ... 1.4)")
    p.add_argument("--grid-seq-factors", type=float, nargs="+", default=None, metavar="S",
                   help="with --joint: seq_factor values (default 6 8 ... 20)")
    p.add_argument("--grid-joins-ms", type=float, nargs="+", default=None, metavar="MS",
                   help="with --joint: decode_join_s values in ms (default 0 5 10 20)")
    p.add_argument("--tolerance-pp", type=float, default=1.0,
                   help="with --joint: share RMS above the best point's that still counts as a "
                        "fit (points, default 1)")
    p.set_defaults(func=_calibrate)


def _steps(lo: float, hi: float, step: float) -> tuple[float, ...]:
    n = max(0, round((hi - lo) / step))
    return tuple(round(lo + i * step, 6) for i in range(n + 1))


def _calibrate(args: argparse.Namespace) -> int:
    if args.joint:
        from kvpool.cli.sim_calibrate_joint import calibrate_joint

        return calibrate_joint(args)
    from kvpool.engine.emulated.profile import load_profile, write_profile
    from kvpool.sim.calibrate import calibrated_profile, curve_for, fit, load_curves
    from kvpool.sim.trace import default_trace_path, load_trace

    try:
        curve = curve_for(args.trace, args.figure, load_curves(args.curves))
        if curve is None:
            raise KvpoolError(f"{args.trace} is not one of the paper's workloads; name the "
                              f"figure to fit with --figure")
        base = load_profile(args.base_profile)
        reqs = load_trace(args.trace, args.limit)
        points = fit(reqs, base, curve, _steps(args.factors[0], args.factors[1], FACTOR_STEP),
                     _steps(args.joins_ms[0] / 1000, args.joins_ms[1] / 1000, JOIN_STEP_S),
                     refine=not args.no_refine, jobs=args.jobs,
                     on_point=lambda p: print(f"  f={p.decode_factor:.3g} "
                                              f"J={p.decode_join_s * 1000:.3g} ms "
                                              f"loss={p.loss:.1f}", file=sys.stderr))
    except KvpoolError as exc:
        print(f"kvpool sim calibrate: {exc}", file=sys.stderr)
        return 2
    trace = (args.trace or default_trace_path()).name
    profile = calibrated_profile(base, points[0], curve, trace, args.name)
    out = args.out or Path("out") / f"{profile.name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    write_profile(profile, out)
    if args.json:
        for p in points:
            print(json.dumps({"decode_factor": p.decode_factor, "decode_join_s": p.decode_join_s,
                              "loss": p.loss, "share_rms_pp": p.share_rms_pp,
                              "share_at_ms": p.share_at_ms, "tbt_ms": p.tbt_ms}))
    _print_fit(profile, out, len(points))
    return 0


def _print_fit(profile: object, out: Path, tried: int) -> None:
    from kvpool.engine.emulated.profile import EngineProfile

    assert isinstance(profile, EngineProfile) and profile.calibration is not None
    cal = profile.calibration
    stream = sys.stderr
    print(f"{profile.name}: decode_factor {cal.decode_factor:.3g}, decode_join_s "
          f"{cal.decode_join_s * 1000:.3g} ms ({tried} points tried); written to {out}",
          file=stream)
    print("threshold_ms  simulated_%  paper_%", file=stream)
    for k, v in cal.paper_share_at_ms.items():
        print(f"{k:>12}  {cal.share_at_ms.get(k, float('nan')):11.2f}  {v:7.2f}", file=stream)
    for k, v in cal.paper_tbt_ms.items():
        print(f"TBT {k} {cal.tbt_ms.get(k, float('nan')):.1f} ms (paper {v:.0f})", file=stream)
    print(f"share residual (RMS) {cal.share_rms_pp:.2f} points", file=stream)
