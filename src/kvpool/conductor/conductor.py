"""The conductor: one scheduling decision per request, pure logic over a ClusterView.

    match   = index.match(request blocks)           prefix held by each prefill instance
    prefill = prefill policy (match, queues, cost)  instance, reused prefix, predicted TTFT
    decode  = least predicted TBT that holds it     decode instance (the prefill's own
                                                    on a worker that does both)
    verdict = admission policy                      Accepted(...) or Rejected(reason, loads)

The caller books an Accepted decision with `ClusterView.record_accept` and runs it.
"""

from __future__ import annotations

from kvpool.clock import Clock
from kvpool.conductor.admission import AdmissionPolicy, create_admission
from kvpool.conductor.config import ConductorConfig
from kvpool.conductor.cost import CostModel
from kvpool.conductor.decode import select_decode
from kvpool.conductor.prefill import PrefillPolicy, create_prefill_policy
from kvpool.conductor.types import Accepted, Decision, RequestInfo
from kvpool.conductor.view import ClusterView, PrefixLookup
from kvpool.errors import InvalidArgument


class Conductor:
    def __init__(self, config: ConductorConfig | None = None,
                 cost: CostModel | None = None, clock: Clock | None = None) -> None:
        self.config = config or ConductorConfig()
        self.clock = clock
        self.cost = cost or CostModel()
        self.prefill_policy: PrefillPolicy = create_prefill_policy(
            self.config.prefill_policy, self.cost, self.config)
        self.admission: AdmissionPolicy = create_admission(
            self.config.admission, self.cost, self.config)

    def schedule(self, req: RequestInfo, view: ClusterView, now: float | None = None,
                 prefixes: PrefixLookup | None = None) -> Decision:
        """Decide where `req` runs, or refuse it. Reads `view`, changes nothing.

        `prefixes`: where the prefill instances' cached prefixes are read (instance ids as in
        `view.prefill`); None = `view.index`.

        `now` defaults to the injected clock's time (the live proxy); the simulator passes its
        virtual time. Raises InvalidArgument for an empty prompt or a view without instances.
        """
        if now is None:
            if self.clock is None:
                raise InvalidArgument("schedule() needs `now` or a Conductor built with a clock")
            now = self.clock.now()
        if req.input_len <= 0:
            raise InvalidArgument(f"request {req.request_id}: input_len must be > 0")
        if not view.prefill:
            raise InvalidArgument("the cluster view has no prefill instance")
        match = (prefixes or view.index).match(req.block_hashes)
        prefill = self.prefill_policy.choose(req, match, view, now)
        decode = select_decode(self.cost, view, req, prefill.instance_id)
        verdict = self.admission.at_arrival(req, prefill, decode, view, now)
        if verdict is not None:
            return verdict
        if decode is None:
            raise InvalidArgument("the cluster view has no decode instance")
        return Accepted(prefill, decode)

