"""Admission policies ([A] section 7), swapped by name through ADMISSION_POLICIES.

Load is predicted time over its limit: prefill load = predicted TTFT / l_ttft, decode load =
max(predicted TBT / l_tbt, KV tokens / decode VRAM capacity). The predicted TBT is the
statistic the SLO is judged on (the mean of the request's longest 10% of gaps,
`tbt_statistic_s`): the step of the batch it joins, plus the join stalls it will live through.
A request is refused when a load exceeds 1. With an absolute TTFT limit, the part of a
request's predicted prefill time over the limit that the cost model cannot prove
(`CostModel.proven_prefill_s`: for a model learned from measurements, what was measured) is not
held against it (`judged`): a request is refused as unable to meet the limit on an idle cluster
only by measurements, never by an extrapolation, and otherwise waits at worst for an idle
instance.

- `none`: the baseline. At arrival only the prefill stage checks its own load; the decode stage
  checks its load when the KV arrives (`at_decode`) and may refuse after the prefill was spent.
- `early_rejection`: at arrival, refuse on max(prefill load, current decode load).
- `early_rejection_predicted`: like early rejection, but the decode load is the one predicted
  for the moment this request's prefill ends (system-level prediction with horizon t_d).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import Protocol

from kvpool.conductor.config import ConductorConfig
from kvpool.conductor.cost import CostModel
from kvpool.conductor.decode import active_tbt_s, predicted_at, tbt_statistic_s
from kvpool.conductor.types import DecodeChoice, PrefillChoice, Rejected, RequestInfo
from kvpool.conductor.view import ClusterView, DecodeLoad
from kvpool.registry import lookup


class AdmissionPolicy(Protocol):
    def at_arrival(self, req: RequestInfo, prefill: PrefillChoice, decode: DecodeChoice | None,
                   view: ClusterView, now: float) -> Rejected | None: ...

    def at_decode(self, req: RequestInfo, d: DecodeLoad, num_running: int,
                  running_tokens: int) -> Rejected | None: ...


class _Base:
    def __init__(self, cost: CostModel, config: ConductorConfig) -> None:
        self.cost = cost
        self.config = config

    def ttft_limit_s(self, prefill: PrefillChoice) -> float:
        k = self.config.ttft_slo_relative
        return self.config.ttft_slo_s if k is None else k * prefill.unloaded_ttft_s

    def judged(self, req: RequestInfo, prefill: PrefillChoice) -> PrefillChoice:
        """`prefill` with its prefill time cut to what keeps its unloaded TTFT at the absolute
        limit, unless the cost model proves more (see the module docstring)."""
        limit = self.config.ttft_slo_s
        if self.config.ttft_slo_relative is not None or prefill.unloaded_ttft_s <= limit:
            return prefill
        proven = self.cost.proven_prefill_s(req.input_len, prefill.prefix_len)
        held = min(prefill.prefill_s, max(limit - prefill.transfer_s, proven))
        while held > proven and prefill.transfer_s + held > limit:  # rounding of the sum
            held = math.nextafter(held, 0.0)
        return prefill if held == prefill.prefill_s else replace(prefill, prefill_s=held)

    def prefill_load(self, prefill: PrefillChoice) -> float:
        limit = self.ttft_limit_s(prefill)
        return prefill.ttft_s / limit if limit > 0 else 0.0

    def decode_load(self, tbt_s: float, tokens: int, capacity: int) -> float:
        return max(tbt_s / self.config.tbt_slo_s, tokens / capacity if capacity else 0.0)

    def _verdict(self, prefill: PrefillChoice, tbt_s: float, p_load: float, d_load: float,
                 stage: str = "arrival") -> Rejected | None:
        if p_load <= 1.0 and d_load <= 1.0:
            return None
        if p_load > 1.0 and p_load >= d_load:
            reason = "ttft"
        else:
            reason = "tbt" if tbt_s > self.config.tbt_slo_s else "kv_capacity"
        return Rejected(reason, stage, prefill.ttft_s, tbt_s, p_load, d_load,
                        prefill.unloaded_ttft_s, self.ttft_limit_s(prefill), prefill.prefix_len)

    def at_decode(self, req: RequestInfo, d: DecodeLoad, num_running: int,
                  running_tokens: int) -> Rejected | None:
        return None


class NoAdmission(_Base):
    def at_arrival(self, req: RequestInfo, prefill: PrefillChoice, decode: DecodeChoice | None,
                   view: ClusterView, now: float) -> Rejected | None:
        tbt = decode.tbt_s if decode is not None else 0.0
        judged = self.judged(req, prefill)
        return self._verdict(judged, tbt, self.prefill_load(judged), 0.0)

    def at_decode(self, req: RequestInfo, d: DecodeLoad, num_running: int,
                  running_tokens: int) -> Rejected | None:
        """The decode stage's own check when the KV arrives: the batch with this request."""
        tokens = running_tokens + req.input_len
        tbt = tbt_statistic_s(self.cost, self.cost.decode_step_s(num_running + 1, tokens),
                              req.output_len, d.join_rate())
        load = self.decode_load(tbt, tokens, d.kv_capacity_tokens)
        if load <= 1.0:
            return None
        reason = "tbt" if tbt > self.config.tbt_slo_s else "kv_capacity"
        return Rejected(reason, "decode", 0.0, tbt, 0.0, load)


class _EarlyBase(_Base):
    """Refuse at arrival on max(prefill load, decode load); subclasses say which decode load."""

    def at_arrival(self, req: RequestInfo, prefill: PrefillChoice, decode: DecodeChoice | None,
                   view: ClusterView, now: float) -> Rejected | None:
        judged = self.judged(req, prefill)
        p_load = self.prefill_load(judged)
        if decode is None:
            return self._verdict(judged, 0.0, p_load, 0.0)
        d = view.decode[decode.instance_id]
        step, tokens = self.decode_estimate(req, d, prefill, now)
        tbt = tbt_statistic_s(self.cost, step, req.output_len, d.join_rate())
        return self._verdict(judged, tbt, p_load,
                             self.decode_load(tbt, tokens, d.kv_capacity_tokens))

    def decode_estimate(self, req: RequestInfo, d: DecodeLoad, prefill: PrefillChoice,
                        now: float) -> tuple[float, int]:
        """(step s, KV tokens) of decode instance `d` once it holds `req`."""
        raise NotImplementedError


class EarlyRejection(_EarlyBase):
    """The decode load as it is now."""

    def decode_estimate(self, req: RequestInfo, d: DecodeLoad, prefill: PrefillChoice,
                        now: float) -> tuple[float, int]:
        return active_tbt_s(self.cost, d, req), d.active_tokens + req.input_len


class PredictedEarlyRejection(_EarlyBase):
    """The decode load predicted for when this request's prefill ends (horizon t_d)."""

    def decode_estimate(self, req: RequestInfo, d: DecodeLoad, prefill: PrefillChoice,
                        now: float) -> tuple[float, int]:
        count, tokens = predicted_at(d, now + prefill.ttft_s, self.config.decode_horizon_s)
        tokens += req.input_len
        return self.cost.decode_step_s(count + 1, tokens), tokens


AdmissionFactory = Callable[[CostModel, ConductorConfig], AdmissionPolicy]

ADMISSION_POLICIES: dict[str, AdmissionFactory] = {
    "none": NoAdmission,
    "early_rejection": EarlyRejection,
    "early_rejection_predicted": PredictedEarlyRejection,
}


def create_admission(name: str, cost: CostModel, config: ConductorConfig) -> AdmissionPolicy:
    return lookup(ADMISSION_POLICIES, "admission policy", name)(cost, config)
