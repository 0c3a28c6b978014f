"""Per-request record kept by the simulators, and the TBT statistic."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from kvpool.conductor.decode import TBT_TOP_SHARE, top_gaps
from kvpool.errors import InvalidArgument
from kvpool.sim.trace import TraceRequest

TBT_STATS = ("top10", "mean")
"""How a request's TBT is summarised: [F]'s mean of the longest 10% of gaps, or the mean gap."""


@dataclass(slots=True)
class SimRequest:
    req: TraceRequest
    first_token_s: float | None = None
    finish_s: float | None = None
    tbt_s: float = 0.0
    rejected_stage: str | None = None
    """None, 'arrival' or 'decode'."""
    rejected_reason: str | None = None
    prefill_gpu_s: float = 0.0
    reused_tokens: int = 0
    transfer_s: float = 0.0
    """Time spent fetching a remote prefix before the prefill (0 when computed locally)."""
    # batch-engine bookkeeping
    engine_id: int = -1
    join_s: float = 0.0
    join_seg: int = 0
    join_step: int = 0
    finish_step: int = 0
    prefilled_tokens: int = 0
    prefix_len: int = 0
    # preemption by recomputation (colocated vLLM baseline)
    decoded: int = 0
    """Tokens produced after the first one in earlier residencies (before a preemption)."""
    num_preempted: int = 0
    last_token_s: float | None = None
    """Time of the last token before the current residency; None = the first token."""
    prior_gaps: list[tuple[float, int]] = field(default_factory=list)
    """Inter-token gaps of earlier residencies, as (gap, count) runs."""

    @property
    def ttft_s(self) -> float | None:
        if self.first_token_s is None:
            return None
        return self.first_token_s - self.req.arrival_s

    @property
    def completed(self) -> bool:
        return self.finish_s is not None and self.rejected_stage is None

    @property
    def mean_gap_s(self) -> float:
        """Mean time between the request's tokens ([A]'s "s/token"); 0 for one token."""
        if self.finish_s is None or self.first_token_s is None or self.req.output_len < 2:
            return 0.0
        return (self.finish_s - self.first_token_s) / (self.req.output_len - 1)

    def tbt(self, stat: str = "top10") -> float:
        """The TBT by `stat`: "top10", [F] 5.1's mean of the longest 10% of gaps (`tbt_s`),
        or "mean", the mean gap."""
        if stat not in TBT_STATS:
            raise InvalidArgument(f"TBT statistic must be one of {TBT_STATS}, got {stat!r}")
        return self.tbt_s if stat == "top10" else self.mean_gap_s

    def meets(self, ttft_slo_s: float, tbt_slo_s: float, stat: str = "top10") -> bool:
        ttft = self.ttft_s
        return (self.completed and ttft is not None and ttft <= ttft_slo_s
                and self.tbt(stat) <= tbt_slo_s)


def top_share_mean(gaps: Iterable[tuple[float, int]], share: float = TBT_TOP_SHARE) -> float:
    """Mean of the largest ceil(share * n) values of a run-length list of (value, count)."""
    runs = sorted((g for g in gaps if g[1] > 0), reverse=True)
    total = sum(c for _, c in runs)
    if total == 0:
        return 0.0
    want = top_gaps(total, share)
    taken = 0
    acc = 0.0
    for value, count in runs:
        use = min(count, want - taken)
        acc += value * use
        taken += use
        if taken == want:
            break
    return acc / want
