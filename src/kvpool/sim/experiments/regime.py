"""Derived operating regimes for the overload experiment ([A] section 8.2, Table 3).

Nothing here is tuned to the paper's rejection counts; every value follows from published
numbers, the trace and the cost model:

- offered-load matched replay speed: the speed-up at which our trace offers the decode pool
  as many output tokens per second as [A]'s trace did at its 2x replay;
- SLO-matched limits ([A] section 2): l_ttft = 10x and l_tbt = 5x the latency of the trace's
  mean request served alone;
- t_d of [A] 7.4: the mean output length times the step time at the offered decode rate.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvpool.conductor import CostModel
from kvpool.errors import InvalidArgument
from kvpool.sim.engine import EngineConfig
from kvpool.sim.trace import TraceRequest

PAPER_A_REQUESTS_PER_HOUR = 23_608
"""[A] section 4: the trace behind Table 3 has 23,608 requests in one hour."""
PAPER_A_MEAN_OUTPUT = 182
PAPER_A_MEAN_INPUT = 7_590
PAPER_A_SPEED = 2.0
PAPER_TTFT_FACTOR = 10.0
PAPER_TBT_FACTOR = 5.0


@dataclass(frozen=True, slots=True)
class TraceLoad:
    """What a trace offers per second of replay."""

    span_s: float
    mean_input: float
    mean_output: float
    output_tokens_per_s: float
    mean_context: float
    """Output-token-weighted mean context of a decode step (input + half the output)."""
    prefill_s_per_s: float
    """Prefill compute seconds offered per second, prefixes reused from an unbounded pool."""


def trace_load(reqs: Sequence[TraceRequest], cost: CostModel, block_size: int = 512) -> TraceLoad:
    if len(reqs) < 2:
        raise InvalidArgument(f"need at least 2 requests to measure a rate, got {len(reqs)}")
    span = max(r.arrival_s for r in reqs) - min(r.arrival_s for r in reqs)
    if span <= 0:
        raise InvalidArgument("all requests arrive at once: no rate to measure")
    seen: set[int] = set()
    prefill = 0.0
    for r in reqs:
        hit = 0
        while hit < len(r.block_hashes) and r.block_hashes[hit] in seen:
            hit += 1
        seen.update(r.block_hashes)
        prefill += cost.prefill_s(r.input_len, min(hit * block_size, r.input_len))
    out = sum(max(0, r.output_len - 1) for r in reqs)
    ctx = sum(max(0, r.output_len - 1) * (r.input_len + r.output_len / 2) for r in reqs)
    return TraceLoad(span, sum(r.input_len for r in reqs) / len(reqs),
                     sum(r.output_len for r in reqs) / len(reqs), out / span,
                     ctx / out if out else 0.0, prefill / span)


def matched_speed(load: TraceLoad) -> float:
    """Replay speed-up at which the trace offers [A]'s decode token rate at 2x."""
    # decode steps make every token but the first, which comes from the prefill
    paper_rate = PAPER_A_SPEED * PAPER_A_REQUESTS_PER_HOUR * (PAPER_A_MEAN_OUTPUT - 1) / 3600.0
    if load.output_tokens_per_s <= 0:
        raise InvalidArgument("the trace has no output tokens to match")
    return paper_rate / load.output_tokens_per_s


def matched_slos(load: TraceLoad, cost: CostModel) -> tuple[float, float]:
    """(l_ttft, l_tbt): 10x and 5x the mean request's latency when served alone ([A] 2)."""
    n = round(load.mean_input)
    return (PAPER_TTFT_FACTOR * cost.prefill_s(n),
            PAPER_TBT_FACTOR * cost.decode_step_s(1, n))


def _per_seq_s(cost: CostModel, context: float) -> float:
    return cost.decode_per_seq_s + cost.decode_per_token_s * context


def decode_horizon_s(load: TraceLoad, cost: CostModel, num_decode: int, speed: float,
                     kv_capacity_tokens: int = EngineConfig().kv_capacity_tokens) -> float:
    """t_d: mean output length times the step time at the batch the offered rate sustains,
    or, where no batch sustains it (the queue grows), at the batch that fills the VRAM."""
    rate = load.output_tokens_per_s * speed / num_decode
    per_seq = _per_seq_s(cost, load.mean_context)
    full = kv_capacity_tokens / max(load.mean_context + load.mean_output / 2, 1.0)
    batch = (full if rate * per_seq >= 1.0
             else min(full, rate * cost.decode_base_s / (1.0 - rate * per_seq)))
    return load.mean_output * (cost.decode_base_s + per_seq * batch)
