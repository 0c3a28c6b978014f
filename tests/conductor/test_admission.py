from __future__ import annotations

from dataclasses import replace

import pytest

from kvpool.conductor import (
    ADMISSION_POLICIES,
    Accepted,
    ClusterView,
    Conductor,
    ConductorConfig,
    CostModel,
    Rejected,
)
from kvpool.errors import InvalidArgument
from tests.conductor.conftest import SIMPLE_COST, req, view_with

# step = 10 ms + 10 ms per sequence; l_tbt = 50 ms, so 4 sequences fit and 5 do not
COST = replace(SIMPLE_COST, decode_per_seq_s=0.01)


def make(admission: str) -> Conductor:
    cfg = ConductorConfig(prefill_policy="cache_aware", admission=admission, tbt_slo_s=0.05,
                          decode_horizon_s=10.0)
    return Conductor(cfg, COST)


def loaded_view(active: int, starts: list[float]) -> ClusterView:
    view = view_with({}, num_prefill=1, num_decode=1, kv_capacity_tokens=100_000)
    d = view.decode[0]
    d.num_active = d.num_assigned = active
    for i, s in enumerate(starts):
        d.planned[100 + i] = (s, 0)
    return view


def test_registry() -> None:
    assert sorted(ADMISSION_POLICIES) == ["early_rejection", "early_rejection_predicted", "none"]
    with pytest.raises(InvalidArgument, match="unknown admission"):
        Conductor(ConductorConfig(admission="maybe"))


def test_early_rejection_uses_current_decode_load() -> None:
    view = loaded_view(4, [0.0] * 4)
    r = make("early_rejection").schedule(req(0, [1]), view, 9.5)
    assert isinstance(r, Rejected)
    assert (r.reason, r.stage) == ("tbt", "arrival")
    assert r.predicted_tbt_s == pytest.approx(0.06)
    assert r.decode_load == pytest.approx(1.2)
    # the baseline does not look at decode at arrival
    assert isinstance(make("none").schedule(req(0, [1]), view, 9.5), Accepted)


def test_prediction_drops_requests_that_finish_before_prefill_ends() -> None:
    # 4 decodes started at t=0 last t_d = 10 s; this prefill ends at 9.5 + 0.512 = 10.012
    view = loaded_view(4, [0.0] * 4)
    d = make("early_rejection_predicted").schedule(req(0, [1]), view, 9.5)
    assert isinstance(d, Accepted)


def test_prediction_counts_requests_still_in_prefill() -> None:
    # nothing is decoding now, but 4 accepted requests start decoding at t=0.3
    view = loaded_view(0, [0.3] * 4)
    assert isinstance(make("early_rejection").schedule(req(0, [1]), view, 0.0), Accepted)
    r = make("early_rejection_predicted").schedule(req(0, [1]), view, 0.0)
    assert isinstance(r, Rejected) and r.reason == "tbt"
    assert r.decode_load == pytest.approx(1.2)


def test_kv_capacity_counts_as_decode_load() -> None:
    view = loaded_view(1, [0.0])
    view.decode[0].active_tokens = 99_800
    r = make("early_rejection").schedule(req(0, [1]), view, 0.0)
    assert isinstance(r, Rejected) and r.reason == "kv_capacity"
    assert r.decode_load == pytest.approx(100_312 / 100_000)


def test_baseline_checks_decode_when_kv_arrives() -> None:
    adm = make("none").admission
    view = loaded_view(0, [])
    assert adm.at_decode(req(0, [1]), view.decode[0], 3, 0) is None
    r = adm.at_decode(req(0, [1]), view.decode[0], 4, 0)
    assert isinstance(r, Rejected)
    assert (r.reason, r.stage) == ("tbt", "decode")
    # the early-rejection policies never refuse at decode
    assert make("early_rejection").admission.at_decode(req(0, [1]), view.decode[0], 50, 0) is None


def test_record_accept_books_queue_nic_and_decode() -> None:
    view = view_with({0: [1, 2, 3, 4]})
    view.prefill[0].busy_until_s = 5.0
    c = Conductor(ConductorConfig(admission="none"), SIMPLE_COST)
    r = req(7, [1, 2, 3, 4, 9])
    d = c.schedule(r, view, 1.0)
    assert isinstance(d, Accepted)
    view.record_accept(r, d, 1.0)
    assert view.prefill[1].busy_until_s == pytest.approx(1.514048)
    assert view.prefill[0].nic_busy_until_s == pytest.approx(1.002048)
    dec = view.decode[d.decode.instance_id]
    assert (dec.num_assigned, dec.assigned_tokens) == (1, 2560)
    assert dec.planned[7] == (pytest.approx(1.514048), 2560)
    view.record_decode_start(d.decode.instance_id, r, 2.0)
    view.record_decode_end(d.decode.instance_id, r, started=True)
    assert (dec.num_assigned, dec.num_active, dec.active_tokens, dec.planned) == (0, 0, 0, {})


def test_cost_model_is_shared(cost: CostModel) -> None:
    c = Conductor(cost=cost)
    assert c.prefill_policy.cost is cost  # type: ignore[attr-defined]
