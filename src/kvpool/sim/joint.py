"""One calibration of the decode terms on several of Mooncake's curves at once
(`kvpool sim calibrate --joint`), and the set of terms that fit about as well.

A fit on one curve is under-identified: a slower step for every system and a join cost for
disaggregated decode alone trade against each other, and points that fit Fig.1 equally well
give very different gains. Fitting Fig.1 (conversation) and Fig.7 (synthetic) together pins
them, because the two workloads load a decode instance differently (the conversation trace
runs about three times the batch and context of the synthetic one) while the hardware is the
same. Every term is shared by both workloads; nothing is fitted per curve:

- `decode_factor` f: the step's fixed and per-token terms times f (the GPU pass: reading the
  weights and the batch's KV, whose one-request cost [F] Fig.14 measures);
- `seq_factor` s: the per-sequence term times s (the work a served batch does per request and
  the one-request microbenchmark cannot show: sampling, detokenising, scheduling, streaming);
- `decode_join_s` J: seconds added to a disaggregated decode step per request joining it.

The best point has the lowest joint loss (the mean of each curve's loss, calibrate.score).
Its *neighbourhood* is every grid point whose share RMS on each curve is within
`tolerance_pp` of the best point's on that curve: the terms the two curves cannot tell
apart, over which the experiments report their band.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace

from kvpool.engine.emulated.profile import DecodeCalibration, EngineProfile
from kvpool.errors import InvalidArgument
from kvpool.sim.calibrate import FitPoint, PaperCurve, evaluate_profile, with_decode_terms
from kvpool.sim.trace import TraceRequest

JOINT_FIGURES = ("fig1_conversation", "fig7_synthetic")
JOINT_TRACES = {"fig1_conversation": "conversation_trace.jsonl",
                "fig7_synthetic": "synthetic_trace.jsonl"}
FACTORS = (0.8, 0.9, 1.0, 1.1, 1.2, 1.3, 1.4)
SEQ_FACTORS = (6.0, 8.0, 10.0, 12.0, 14.0, 16.0, 18.0, 20.0)
JOINS_S = (0.0, 0.005, 0.01, 0.02)
"""The default grid (224 points, about 10 minutes on 2 cores with --jobs 2): it spans the
ridge along which a faster pass trades against a larger per-sequence term, and joins from none
to four times the best fit's (a 20 ms join already misses Fig.7 by 10 points)."""
TOLERANCE_PP = 1.0


@dataclass(frozen=True, slots=True)
class Workload:
    curve: PaperCurve
    trace: str
    """File name of the trace replayed."""
    reqs: Sequence[TraceRequest]


@dataclass(frozen=True, slots=True)
class Terms:
    decode_factor: float
    seq_factor: float
    decode_join_s: float

    def profile(self, base: EngineProfile) -> EngineProfile:
        return with_decode_terms(base, self.decode_factor, self.decode_join_s, self.seq_factor)

    def as_dict(self) -> dict[str, float]:
        return {"decode_factor": self.decode_factor, "seq_factor": self.seq_factor,
                "decode_join_s": self.decode_join_s}


@dataclass(frozen=True, slots=True)
class JointPoint:
    terms: Terms
    fits: dict[str, FitPoint]
    """Each curve's fit at these terms, by figure."""

    @property
    def loss(self) -> float:
        return sum(f.loss for f in self.fits.values()) / len(self.fits)

    def rms(self, figure: str) -> float:
        return self.fits[figure].share_rms_pp


def grid(factors: Sequence[float] = FACTORS, seq_factors: Sequence[float] = SEQ_FACTORS,
         joins_s: Sequence[float] = JOINS_S) -> list[Terms]:
    return [Terms(f, s, j) for f in factors for s in seq_factors for j in joins_s]


def evaluate_joint(workloads: Sequence[Workload], base: EngineProfile,
                   terms: Terms) -> JointPoint:
    profile = terms.profile(base)
    return JointPoint(terms, {w.curve.figure: evaluate_profile(w.reqs, profile, w.curve,
                                                               terms.decode_factor)
                              for w in workloads})


_WORKLOADS: Sequence[Workload] = ()


def _in_child(args: tuple[EngineProfile, Terms]) -> JointPoint:
    return evaluate_joint(_WORKLOADS, *args)


def joint_fit(workloads: Sequence[Workload], base: EngineProfile, terms: Sequence[Terms],
              jobs: int = 1,
              on_point: Callable[[JointPoint], None] | None = None) -> list[JointPoint]:
    """Every point of `terms` evaluated on every workload, best (lowest joint loss) first."""
    if not workloads or not terms:
        raise InvalidArgument("a joint fit needs at least one workload and one grid point")
    out: list[JointPoint] = []
    if jobs <= 1:
        for t in terms:
            out.append(evaluate_joint(workloads, base, t))
            if on_point:
                on_point(out[-1])
    else:
        global _WORKLOADS
        _WORKLOADS = workloads
        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork")) as pool:
            for point in pool.map(_in_child, [(base, t) for t in terms]):
                out.append(point)
                if on_point:
                    on_point(point)
    return sorted(out, key=lambda p: p.loss)


def neighbourhood(points: Sequence[JointPoint],
                  tolerance_pp: float = TOLERANCE_PP) -> list[JointPoint]:
    """The points (best first) whose share RMS on every curve is at most the best point's
    on that curve plus `tolerance_pp`; the best point is always the first."""
    best = min(points, key=lambda p: p.loss)
    return [p for p in sorted(points, key=lambda p: p.loss)
            if all(p.rms(fig) <= best.rms(fig) + tolerance_pp + 1e-9 for fig in best.fits)]


def _curve_record(fit: FitPoint, curve: PaperCurve, trace: str) -> dict[str, object]:
    return {"trace": trace, "share_rms_pp": round(fit.share_rms_pp, 3),
            "share_at_ms": {k: round(v, 2) for k, v in fit.share_at_ms.items()},
            "paper_share_at_ms": dict(curve.share_at_ms),
            "tbt_ms": {k: round(v, 2) for k, v in fit.tbt_ms.items()},
            "paper_tbt_ms": dict(curve.tbt_ms)}


def joint_profile(base: EngineProfile, points: Sequence[JointPoint],
                  workloads: Sequence[Workload], name: str,
                  tolerance_pp: float = TOLERANCE_PP) -> EngineProfile:
    """`base` with the best point's terms, the record of each curve's fit and the
    neighbourhood."""
    near = neighbourhood(points, tolerance_pp)
    best = near[0]
    first = workloads[0]
    fit0 = best.fits[first.curve.figure]
    record = DecodeCalibration(
        figure="+".join(w.curve.figure for w in workloads),
        trace="+".join(w.trace for w in workloads), base_profile=base.name,
        decode_factor=best.terms.decode_factor, decode_join_s=best.terms.decode_join_s,
        share_rms_pp=round(fit0.share_rms_pp, 3),
        share_at_ms={k: round(v, 2) for k, v in fit0.share_at_ms.items()},
        paper_share_at_ms=dict(first.curve.share_at_ms),
        tbt_ms={k: round(v, 2) for k, v in fit0.tbt_ms.items()},
        paper_tbt_ms=dict(first.curve.tbt_ms), seq_factor=best.terms.seq_factor,
        curves={w.curve.figure: _curve_record(best.fits[w.curve.figure], w.curve, w.trace)
                for w in workloads},
        neighbourhood=[{**p.terms.as_dict(),
                        **{f"{fig}_rms_pp": round(p.rms(fig), 3) for fig in p.fits}}
                       for p in near])
    figures = ", ".join(f"[F] {w.curve.figure}" for w in workloads)
    return replace(best.terms.profile(base), name=name, calibration=record,
                   description=(f"{base.name} with its decode terms fitted jointly to Mooncake's "
                                f"own TBT curves ({figures}) by `kvpool sim calibrate --joint`; "
                                f"see docs/sim.md."))


def neighbour_terms(profile: EngineProfile) -> list[Terms]:
    """The terms of `profile`'s recorded neighbourhood (best first), or [] without one."""
    cal = profile.calibration
    if cal is None or not cal.neighbourhood:
        return []
    return [Terms(n["decode_factor"], n["seq_factor"], n["decode_join_s"])
            for n in cal.neighbourhood]
