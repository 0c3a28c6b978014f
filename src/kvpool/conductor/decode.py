"""Decode instance selection: the instance with the lowest predicted TBT once the request joins,
and the prediction of the TBT statistic the SLO is judged on.

The prediction counts every request already assigned to the instance (running, waiting for
VRAM, or still in prefill), so a burst of arrivals spreads over the pool instead of piling onto
the instance that looks idle now.
"""

from __future__ import annotations

import math

from kvpool.conductor.cost import CostModel
from kvpool.conductor.types import DecodeChoice, RequestInfo
from kvpool.conductor.view import ClusterView, DecodeLoad

TBT_TOP_SHARE = 0.10
"""[F] 5.1: a request's TBT is the mean of its longest 10% of inter-token gaps."""


def assigned_tbt_s(cost: CostModel, d: DecodeLoad, req: RequestInfo) -> float:
    return cost.decode_step_s(d.num_assigned + 1, d.assigned_tokens + req.input_len)


def active_tbt_s(cost: CostModel, d: DecodeLoad, req: RequestInfo) -> float:
    return cost.decode_step_s(d.num_active + 1, d.active_tokens + req.input_len)


def top_gaps(num_gaps: int, share: float = TBT_TOP_SHARE) -> int:
    """How many of a request's `num_gaps` inter-token gaps its TBT statistic averages: the
    longest ceil(share x n), at least one."""
    return max(1, math.ceil(share * num_gaps - 1e-9))


def tbt_statistic_s(cost: CostModel, step_s: float, output_len: int, join_rate: float) -> float:
    """Predicted TBT statistic of a request ([F] 5.1: the mean of its longest 10% of gaps) on a
    batch whose step takes `step_s` and that `join_rate` requests per second join.

    Each join lengthens one step by `cost.decode_join_s`; those steps are the request's longest
    gaps, so with N joins expected over its life (output_len steps) and m = 10% of its gaps,
    the statistic is step + join cost x min(N, m) / m. Equal to `step_s` when joins are free.
    """
    if not cost.decode_join_s:
        return step_s
    gaps = max(1, output_len - 1)
    top = top_gaps(gaps)
    joins = join_rate * gaps * step_s
    return step_s + cost.decode_join_s * min(joins, top) / top


def predicted_at(d: DecodeLoad, at_s: float, horizon_s: float) -> tuple[int, int]:
    """(sequences, tokens) decoding on `d` at time `at_s`, if every decode lasts `horizon_s`.

    System-level prediction of [A] 7.4: a request counts from its (predicted) decode start
    until that start plus the uniform decode time t_d.
    """
    count = tokens = 0
    for start, ctx in d.planned.values():
        if start <= at_s < start + horizon_s:
            count += 1
            tokens += ctx
    return count, tokens


def select_decode(cost: CostModel, view: ClusterView, req: RequestInfo,
                  prefill_id: int | None = None) -> DecodeChoice | None:
    """The decode instance of the prefill's own worker where it does both
    (`view.colocated`); else the least-loaded one by predicted TBT among those whose KV
    capacity holds the request (all of them when none does), then by assigned requests, then
    by id; None when there is no decode pool."""
    pair = view.colocated.get(prefill_id) if prefill_id is not None else None
    if pair is not None:
        return DecodeChoice(pair, assigned_tbt_s(cost, view.decode[pair], req))
    best: DecodeLoad | None = None
    best_key = (True, 0.0, 0)
    for d in view.decode:
        full = 0 < d.kv_capacity_tokens < d.assigned_tokens + req.input_len
        key = (full, assigned_tbt_s(cost, d, req), d.num_assigned)
        if best is None or key < best_key:
            best, best_key = d, key
    if best is None:
        return None
    return DecodeChoice(best.instance_id, best_key[1])
