"""A cost model learned from measured prefills, kept within what was measured.

    estimate(n, p) = min(fitted(n, p), envelope(n, p))

- fitted: the terms of `cost_fit.fit_terms` (non-negative, bounded by the samples, recency
  weighted, outliers left out), with the attention term linear beyond the longest measured
  context: token pairs count as new tokens x min(n + p, longest n + p measured), so past the
  measured range the estimate grows linearly at most.
- envelope: the longest time measured for a request at least as large as this one (at least as
  many new tokens and token pairs, so at least as much work in every term); none when no such
  request was measured.
- proven (`proven_prefill_s`): what the measurements prove the request takes at least: the
  PROVEN_BY-th longest time measured for a request no larger than it (in both counts); 0 when
  fewer were measured. Admission refuses a request as unreachable on an idle cluster only by
  this, never by an extrapolation (conductor/admission.py).

The decode, transfer and load terms are the base model's (the fit touches the prefill only).
`to_dict` gives the coefficients alone (a CostModel JSON, as `kvpool sim fit` writes one).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from kvpool.conductor.cost import CostModel
from kvpool.conductor.cost_fit import (
    ROBUST,
    FitSettings,
    PrefillFit,
    check_samples,
    fit_terms,
)

PROVEN_BY = 3
"""Measured requests no larger than a request that must each have taken longer than its TTFT
limit before the request is refused as unreachable (one or two slow ones may be a busy host)."""


@dataclass(frozen=True, slots=True)
class MeasuredCostModel(CostModel):
    fit: PrefillFit | None = None
    """The fit the prefill coefficients come from."""
    measured: tuple[tuple[int, int, float], ...] = ()
    """The samples (input_len, prefix_len, seconds) the envelope and the proof read."""
    longest_context: int = 0
    """max(n + p) of the samples: the attention term is linear beyond it (0: no limit)."""
    _new: np.ndarray = field(init=False, repr=False, compare=False)
    _pairs: np.ndarray = field(init=False, repr=False, compare=False)
    _secs: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        CostModel.__post_init__(self)
        arr = np.array(self.measured, dtype=np.float64).reshape(-1, 3)
        n, p = arr[:, 0], arr[:, 1]
        object.__setattr__(self, "_new", n - p)
        object.__setattr__(self, "_pairs", n * n - p * p)
        object.__setattr__(self, "_secs", arr[:, 2])

    def fitted_s(self, input_len: int, prefix_len: int = 0) -> float:
        """The fitted terms, linear beyond the longest measured context."""
        super_s = CostModel.prefill_s(self, input_len, prefix_len)  # checks the arguments
        if not self.longest_context or input_len + prefix_len <= self.longest_context:
            return super_s
        new = input_len - prefix_len
        return (self.prefill_base_s + self.prefill_linear_s * new
                + self.prefill_quadratic_s * new * self.longest_context)

    def envelope_s(self, input_len: int, prefix_len: int = 0) -> float:
        """The longest time measured for a request at least this large (math.inf: none)."""
        new, pairs = input_len - prefix_len, input_len * input_len - prefix_len * prefix_len
        larger = (self._new >= new) & (self._pairs >= pairs)
        return float(np.max(self._secs[larger])) if larger.any() else math.inf

    def prefill_s(self, input_len: int, prefix_len: int = 0) -> float:
        return min(self.fitted_s(input_len, prefix_len), self.envelope_s(input_len, prefix_len))

    def prefill_with_load_s(self, input_len: int, prefix_len: int = 0) -> float:
        loaded = max(self.fitted_s(input_len, prefix_len), prefix_len * self.load_s_per_token)
        return min(loaded, self.envelope_s(input_len, prefix_len))

    def proven_prefill_s(self, input_len: int, prefix_len: int = 0) -> float:
        new, pairs = input_len - prefix_len, input_len * input_len - prefix_len * prefix_len
        times = self._secs[(self._new <= new) & (self._pairs <= pairs)]
        if len(times) < PROVEN_BY:
            return 0.0
        proof = float(np.partition(times, -PROVEN_BY)[-PROVEN_BY])
        return min(proof, self.prefill_with_load_s(input_len, prefix_len))

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(CostModel)}


def learn_prefill(samples: Sequence[tuple[int, int, float]], base: CostModel,
                  settings: FitSettings = ROBUST) -> MeasuredCostModel:
    """`base` with its prefill coefficients fitted to `samples` (oldest first) and kept within
    them. InvalidArgument for fewer than 3 samples or an impossible one."""
    rows = tuple((int(n), int(p), float(s)) for n, p, s in check_samples(samples))
    fit = fit_terms(rows, settings)
    coefs = {f.name: getattr(base, f.name) for f in fields(CostModel)}
    coefs |= {"prefill_base_s": fit.base_s, "prefill_linear_s": fit.linear_s,
              "prefill_quadratic_s": fit.quadratic_s}
    return MeasuredCostModel(**coefs, fit=fit, measured=rows,
                             longest_context=int(max(n + p for n, p, _ in rows)))


def cost_note(cost: CostModel, source: str, input_len: int, prefix_len: int) -> str:
    """`key=value` words saying which model predicted what for a request: its source (fitted,
    cost_file, default), terms, the fit's residual, and for this request the estimate, the
    measured envelope and what the measurements prove."""
    words = [f"cost={source}", f"base={cost.prefill_base_s:.4g}s",
             f"linear={cost.prefill_linear_s:.4g}s/tok",
             f"quadratic={cost.prefill_quadratic_s:.4g}s/tok2",
             f"prefill={cost.prefill_with_load_s(input_len, prefix_len):.3f}s"]
    if isinstance(cost, MeasuredCostModel) and cost.fit is not None:
        env = cost.envelope_s(input_len, prefix_len)
        words[4:4] = [f"residual={cost.fit.residual_s:.3g}s", f"samples={cost.fit.num_samples}",
                      f"outliers={cost.fit.num_outliers}",
                      f"longest={cost.longest_context}"]
        words += [f"fitted={cost.fitted_s(input_len, prefix_len):.3f}s",
                  "envelope=-" if math.isinf(env) else f"envelope={env:.3f}s",
                  f"proven={cost.proven_prefill_s(input_len, prefix_len):.3f}s"]
    return " ".join(words)

