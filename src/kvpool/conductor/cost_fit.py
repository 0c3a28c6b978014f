"""A non-negative, bounded, recency-weighted and outlier-robust fit of the prefill cost terms.

    t(n, p) = base + linear * (n - p) + quadratic * (n^2 - p^2)     n prompt, p reused tokens

Measured prefill times (`(input_len, prefix_len, seconds)`, oldest first) are fitted by
weighted least squares with every coefficient in [0, upper], where `upper` comes from the
samples themselves: each term is a share of a sample's time, so no term may exceed any sample
it is part of (base <= the fastest sample, linear <= min(t / new tokens), quadratic <=
min(t / token pairs)). On a busy host the noise only ever adds time, so these bounds hold for
the true costs; they also keep the quadratic term from growing past what the longest measured
prompt allows.

Weights: a sample `half_life` samples older than the newest weighs half as much. Outliers
(the host was busy for that one): a few Huber reweighting rounds, then samples whose residual
is over `outlier_k` robust scales (1.4826 x the weighted median absolute residual) are left
out and the rest refitted, until the kept set no longer changes.

The box-constrained solve enumerates the 27 faces of the box of the three coefficients (each
at 0, at its bound, or free), solves each face's least squares and keeps the best feasible
one: exact for three unknowns, and dependency-free. Pure functions; nothing here keeps state.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvpool.errors import ConfigError, InvalidArgument

TERMS = ("base", "linear", "quadratic")
HUBER_C = 1.345
"""Huber's tuning constant (95% efficiency under Gaussian noise)."""
MAD_TO_SIGMA = 1.4826


@dataclass(frozen=True, slots=True)
class FitSettings:
    half_life: float = 64.0
    """Samples after which a sample's weight halves (math.inf: all weigh the same)."""
    outlier_k: float = 3.0
    """Residuals over this many robust scales are left out (math.inf: none is)."""
    scale_floor: float = 0.01
    """The robust scale is at least this share of the weighted median time, so that samples
    that a model fits exactly do not make every other sample an outlier."""
    max_rounds: int = 20
    """Huber rounds, and again rounds of leaving outliers out, at most."""

    def __post_init__(self) -> None:
        if not self.half_life > 0 or not self.outlier_k > 0 or self.scale_floor < 0:
            raise ConfigError(f"FitSettings needs half_life > 0, outlier_k > 0 and "
                              f"scale_floor >= 0, got {self}")
        if self.max_rounds < 1:
            raise ConfigError(f"FitSettings.max_rounds must be >= 1, got {self.max_rounds}")


ROBUST = FitSettings()
"""The proxy's settings: recency-weighted, outliers left out."""
PLAIN = FitSettings(half_life=math.inf, outlier_k=math.inf)
"""Every sample weighs the same and none is left out: the bounded non-negative least squares."""


@dataclass(frozen=True, slots=True)
class PrefillFit:
    base_s: float
    linear_s: float
    quadratic_s: float
    upper: tuple[float, float, float]
    """The bounds the samples set on (base, linear, quadratic) (math.inf: none)."""
    residual_s: float
    """Weighted root mean square residual of the samples kept."""
    num_samples: int
    num_outliers: int
    """Samples left out as outliers."""

    @property
    def coefficients(self) -> tuple[float, float, float]:
        return self.base_s, self.linear_s, self.quadratic_s


def check_samples(samples: Sequence[tuple[int, int, float]]) -> np.ndarray:
    """The samples as an (N, 3) float array; InvalidArgument for fewer than 3 or a bad one."""
    rows = [(int(n), int(p), float(s)) for n, p, s in samples]
    if len(rows) < 3:
        raise InvalidArgument(f"a prefill fit needs at least 3 samples, got {len(rows)}")
    for n, p, s in rows:
        if not 0 <= p <= n or not 0 <= s < math.inf:
            raise InvalidArgument(f"bad sample (input_len={n}, prefix_len={p}, seconds={s})")
    return np.array(rows, dtype=np.float64)


def design(arr: np.ndarray) -> np.ndarray:
    """Columns 1, new tokens, token pairs of each (input_len, prefix_len, ...) row."""
    n, p = arr[:, 0], arr[:, 1]
    return np.stack([np.ones_like(n), n - p, n * n - p * p], axis=1)


def term_bounds(a: np.ndarray, secs: np.ndarray) -> np.ndarray:
    """Per column, min(seconds / column) over the samples where the column is > 0."""
    out = np.full(a.shape[1], np.inf)
    for j in range(a.shape[1]):
        used = a[:, j] > 0
        if used.any():
            out[j] = float(np.min(secs[used] / a[used, j]))
    return out


def recency_weights(count: int, half_life: float) -> np.ndarray:
    """Weight of each of `count` samples, oldest first: 1 for the newest."""
    age = np.arange(count - 1, -1, -1, dtype=np.float64)
    return np.power(0.5, age / half_life)


def bounded_lstsq(a: np.ndarray, b: np.ndarray, w: np.ndarray, upper: np.ndarray) -> np.ndarray:
    """argmin sum w (a x - b)^2 over 0 <= x <= upper, by enumerating the box's faces."""
    root = np.sqrt(w)
    scale = np.maximum(np.max(np.abs(a), axis=0), 1e-300)
    aw, bw = a / scale * root[:, None], b * root  # columns scaled to 1: a conditioned solve
    hi = upper * scale
    best, best_cost = np.zeros(a.shape[1]), math.inf
    for face in itertools.product((0, 1, 2), repeat=a.shape[1]):  # 0: at 0, 1: at upper, 2: free
        if any(f == 1 and not math.isfinite(hi[j]) for j, f in enumerate(face)):
            continue
        x = np.array([hi[j] if f == 1 else 0.0 for j, f in enumerate(face)])
        free = [j for j, f in enumerate(face) if f == 2]
        if free:
            rest = bw - aw @ x
            x[free] = np.linalg.lstsq(aw[:, free], rest, rcond=None)[0]
            if np.any(x < 0) or np.any(x > hi * (1 + 1e-12)):
                continue
        cost = float(np.sum((aw @ x - bw) ** 2))
        if cost < best_cost * (1 - 1e-12):
            best, best_cost = x, cost
    return np.minimum(best / scale, upper)


def weighted_median(values: np.ndarray, w: np.ndarray) -> float:
    order = np.argsort(values, kind="stable")
    cum = np.cumsum(w[order])
    return float(values[order][np.searchsorted(cum, cum[-1] / 2)])


def _scale(resid: np.ndarray, w: np.ndarray, floor: float) -> float:
    return max(MAD_TO_SIGMA * weighted_median(np.abs(resid), w), floor, 1e-12)


def fit_terms(samples: Sequence[tuple[int, int, float]],
              settings: FitSettings = ROBUST) -> PrefillFit:
    """The fit of the module docstring over `samples` (oldest first). InvalidArgument for
    fewer than 3 samples or an impossible one (prefix over input, negative time)."""
    arr = check_samples(samples)
    a, secs = design(arr), arr[:, 2]
    upper = term_bounds(a, secs)
    w = recency_weights(len(secs), settings.half_life)
    floor = settings.scale_floor * weighted_median(secs, w)
    x = bounded_lstsq(a, secs, w, upper)
    keep = np.ones(len(secs), dtype=bool)
    if math.isfinite(settings.outlier_k):
        x = _huber(a, secs, w, upper, x, floor, settings.max_rounds)
        x, keep = _leave_outliers_out(a, secs, w, upper, x, floor, settings)
    resid = a[keep] @ x - secs[keep]
    rms = math.sqrt(float(np.sum(w[keep] * resid ** 2) / np.sum(w[keep])))
    return PrefillFit(float(x[0]), float(x[1]), float(x[2]),
                      (float(upper[0]), float(upper[1]), float(upper[2])), rms, len(secs),
                      int(np.sum(~keep)))


def _huber(a: np.ndarray, secs: np.ndarray, w: np.ndarray, upper: np.ndarray, x: np.ndarray,
           floor: float, rounds: int) -> np.ndarray:
    for _ in range(rounds):
        resid = secs - a @ x
        limit = HUBER_C * _scale(resid, w, floor)
        hw = w * np.minimum(1.0, limit / np.maximum(np.abs(resid), 1e-300))
        nxt = bounded_lstsq(a, secs, hw, upper)
        if np.allclose(nxt, x, rtol=1e-9, atol=0):
            return nxt
        x = nxt
    return x


def _leave_outliers_out(a: np.ndarray, secs: np.ndarray, w: np.ndarray, upper: np.ndarray,
                        x: np.ndarray, floor: float,
                        settings: FitSettings) -> tuple[np.ndarray, np.ndarray]:
    """Leave out the samples over `outlier_k` scales and refit, until the kept set holds; the
    result is always the plain weighted fit of the samples kept."""
    keep: np.ndarray | None = None
    for _ in range(settings.max_rounds):
        resid = secs - a @ x
        scale = _scale(resid if keep is None else resid[keep], w if keep is None else w[keep],
                       floor)
        nxt = np.abs(resid) <= settings.outlier_k * scale
        if int(nxt.sum()) < 3 or keep is not None and np.array_equal(nxt, keep):
            break
        keep = nxt
        x = bounded_lstsq(a[keep], secs[keep], w[keep], upper)
    if keep is None:
        keep = np.ones(len(secs), dtype=bool)
        x = bounded_lstsq(a, secs, w, upper)
    return x, keep
