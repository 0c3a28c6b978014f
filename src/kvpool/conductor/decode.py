"""Decode instance selection: the instance with the lowest predicted TBT once the request joins.

The prediction counts every request already assigned to the instance (running, waiting for
VRAM, or still in prefill), so a burst of arrivals spreads over the pool instead of piling onto
the instance that looks idle now.
"""

from __future__ import annotations

from kvpool.conductor.cost import CostModel
from kvpool.conductor.types import DecodeChoice, RequestInfo
from kvpool.conductor.view import ClusterView, DecodeLoad


def assigned_tbt_s(cost: CostModel, d: DecodeLoad, req: RequestInfo) -> float:
    return cost.decode_step_s(d.num_assigned + 1, d.assigned_tokens + req.input_len)


def active_tbt_s(cost: CostModel, d: DecodeLoad, req: RequestInfo) -> float:
    return cost.decode_step_s(d.num_active + 1, d.active_tokens + req.input_len)


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


def select_decode(cost: CostModel, view: ClusterView, req: RequestInfo) -> DecodeChoice | None:
    """Least-loaded decode instance by predicted TBT, then by assigned requests, then by id;
    None when there is no decode pool."""
    best: DecodeLoad | None = None
    best_key = (0.0, 0)
    for d in view.decode:
        key = (assigned_tbt_s(cost, d, req), d.num_assigned)
        if best is None or key < best_key:
            best, best_key = d, key
    if best is None:
        return None
    return DecodeChoice(best.instance_id, best_key[0])
