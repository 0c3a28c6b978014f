"""Results of one simulation run and their summary statistics."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvpool.sim.record import SimRequest


@dataclass(slots=True)
class LoadSample:
    t_s: float
    prefill_load: float
    """Mean over prefill instances of predicted queue time / l_ttft."""
    decode_load: float
    """Mean over decode instances of the current step time / l_tbt."""


@dataclass(slots=True)
class SimResult:
    records: list[SimRequest]
    ttft_slo_s: float
    tbt_slo_s: float
    load: list[LoadSample] = field(default_factory=list)
    num_events: int = 0

    def ttfts(self) -> np.ndarray:
        return np.array([r.ttft_s for r in self.records if r.completed], dtype=np.float64)

    def tbts(self, stat: str = "top10") -> np.ndarray:
        """Completed requests' TBT by `stat` (record.TBT_STATS)."""
        return np.array([r.tbt(stat) for r in self.records if r.completed], dtype=np.float64)

    def attainment(self, ttft_slo_s: float | None = None, tbt_slo_s: float | None = None,
                   stat: str = "top10") -> float:
        """Share of all requests (rejected ones count as misses) within both limits."""
        ttft = self.ttft_slo_s if ttft_slo_s is None else ttft_slo_s
        tbt = self.tbt_slo_s if tbt_slo_s is None else tbt_slo_s
        if not self.records:
            return 0.0
        return sum(r.meets(ttft, tbt, stat) for r in self.records) / len(self.records)

    def rejected(self, stage: str | None = None) -> int:
        return sum(1 for r in self.records
                   if r.rejected_stage is not None and (stage is None or r.rejected_stage == stage))

    def share_at_ms(self, thresholds_ms: Sequence[int], ttft_slo_s: float) -> dict[str, float]:
        """Percent of all requests within `ttft_slo_s` and each TBT threshold, keyed by the
        threshold in ms as a string (the JSON form of the paper's curves)."""
        return {str(ms): 100.0 * self.attainment(ttft_slo_s, ms / 1000) for ms in thresholds_ms}

    def tbt_percentiles_ms(self, pcts: Sequence[int] = (10, 50, 90)) -> dict[str, float]:
        """p10/p50/p90 (by default) of the completed requests' TBT, in ms."""
        tbt = self.tbts()
        if not tbt.size:
            return {}
        return {f"p{q}": float(np.percentile(tbt, q)) * 1000 for q in pcts}

    def hit_rate(self) -> float:
        """Share of prefilled prompt tokens whose KV was reused instead of computed."""
        done = [r for r in self.records if r.first_token_s is not None]
        total = sum(r.req.input_len for r in done)
        return sum(r.reused_tokens for r in done) / total if total else 0.0

    def prefill_gpu_s(self) -> float:
        """Mean prefill compute seconds per prefilled request."""
        done = [r.prefill_gpu_s for r in self.records if r.first_token_s is not None]
        return float(np.mean(done)) if done else 0.0

    def summary(self) -> dict[str, Any]:
        ttft, tbt = self.ttfts(), self.tbts()
        return {
            "num_requests": len(self.records),
            "num_completed": int(ttft.size),
            "rejected": self.rejected(),
            "rejected_arrival": self.rejected("arrival"),
            "rejected_decode": self.rejected("decode"),
            "mean_ttft_s": _stat(ttft, np.mean),
            "p90_ttft_s": _stat(ttft, lambda a: np.percentile(a, 90)),
            "mean_tbt_s": _stat(tbt, np.mean),
            "p90_tbt_s": _stat(tbt, lambda a: np.percentile(a, 90)),
            "slo_attainment": self.attainment(),
            "hit_rate": self.hit_rate(),
            "prefill_gpu_s": self.prefill_gpu_s(),
        }


def _stat(values: np.ndarray, fn: Any) -> float | None:
    return float(fn(values)) if values.size else None
