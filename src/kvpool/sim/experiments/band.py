"""The band of an experiment's result over the calibration's neighbourhood.

A profile fitted jointly (kvpool.sim.joint) records every set of decode terms that fits
Mooncake's curves within a tolerance of the best one. An experiment that depends on the decode
cost reruns on each of them; its result is then the value at the best fit and the range over
the neighbourhood, with the term (the named assumption) whose value moves it most: the term
whose values, each averaged over the points that share it, lie furthest apart.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from kvpool.engine.emulated.profile import EngineProfile, load_profile
from kvpool.errors import ConfigError
from kvpool.sim.joint import Terms, neighbour_terms

TERM_NAMES = ("decode_factor", "seq_factor", "decode_join_s")


def band_profiles(profile: EngineProfile) -> list[tuple[Terms, EngineProfile]]:
    """The profiles of `profile`'s neighbourhood, best first; [] when it records none (or
    its base profile cannot be found)."""
    terms = neighbour_terms(profile)
    if not terms or profile.calibration is None:
        return []
    try:
        base = load_profile(profile.calibration.base_profile)
    except ConfigError:
        return []
    base = _with_engine_terms(base, profile)
    return [(t, t.profile(base)) for t in terms]


def _with_engine_terms(base: EngineProfile, profile: EngineProfile) -> EngineProfile:
    """`base` carrying `profile`'s non-decode engine terms (they are not part of the fit)."""
    return replace(base, chunk_overhead_s=profile.chunk_overhead_s,
                   kv_capacity_tokens=profile.kv_capacity_tokens,
                   chunk_tokens=profile.chunk_tokens)


def band(values: Sequence[tuple[Terms, float | None]]) -> dict[str, Any]:
    """{best, lo, hi, moved_by} of one figure over the neighbourhood (`values` best first;
    None values are left out)."""
    known = [(t, v) for t, v in values if v is not None]
    if not known:
        return {"best": None, "lo": None, "hi": None, "moved_by": None}
    nums = [v for _, v in known]
    return {"best": values[0][1], "lo": min(nums), "hi": max(nums),
            "moved_by": moved_by(known) if max(nums) > min(nums) else None}


def moved_by(values: Sequence[tuple[Terms, float]]) -> str | None:
    """The term whose per-value means of the figure span the widest range."""
    spans: dict[str, float] = {}
    for name in TERM_NAMES:
        groups: dict[float, list[float]] = {}
        for terms, value in values:
            groups.setdefault(getattr(terms, name), []).append(value)
        if len(groups) > 1:
            means = [sum(g) / len(g) for g in groups.values()]
            spans[name] = max(means) - min(means)
    return max(spans, key=lambda k: spans[k]) if spans else None


def bands(profile: EngineProfile, measure: Callable[[EngineProfile], dict[str, float | None]],
          progress: Callable[[Terms], None] | None = None
          ) -> tuple[dict[str, dict[str, Any]], int]:
    """`measure` (figures by key) on every profile of the neighbourhood: the band of each key
    and the number of fits; ({}, 0) without a neighbourhood."""
    profiles = band_profiles(profile)
    per_point: list[tuple[Terms, dict[str, float | None]]] = []
    for terms, prof in profiles:
        if progress:
            progress(terms)
        per_point.append((terms, measure(prof)))
    if not per_point:
        return {}, 0
    keys = list(per_point[0][1])
    return {k: band([(t, m.get(k)) for t, m in per_point]) for k in keys}, len(per_point)


def describe(b: dict[str, Any], unit: str = "%") -> str:
    """'+267% (+200..+310%, seq_factor)': the best fit's value, the range, what moves it."""
    if b.get("best") is None:
        return "-"
    text = f"{b['best']:+.0f}{unit} ({b['lo']:+.0f}..{b['hi']:+.0f}{unit}"
    return text + (f", {b['moved_by']})" if b.get("moved_by") else ")")
