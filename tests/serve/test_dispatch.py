"""Dispatcher pieces that need no worker: rejection mapping and the online cost fit."""

from __future__ import annotations

import pytest

from kvpool.clock import VirtualClock
from kvpool.conductor import Accepted, CostModel
from kvpool.serve.cluster import LiveCluster
from kvpool.serve.config import ProxyConfig
from kvpool.serve.dispatch import REFIT_EVERY, Dispatcher
from kvpool.serve.errors import ApiError
from kvpool.serve.metrics import ProxyMetrics
from kvpool.serve.worker_client import WorkerClient
from tests.serve.test_cluster import D1, P1, info, load


def dispatcher(vclock: VirtualClock, **config: object) -> Dispatcher:
    cost = CostModel(prefill_base_s=0.2, prefill_linear_s=0.0, prefill_quadratic_s=0.0)
    cluster = LiveCluster(cost, vclock)
    for url, role in ((P1, "prefill"), (D1, "decode")):
        cluster.add(url)
        cluster.join(url, info(role))
        cluster.apply_load(url, load([]), 0.0)
    cfg = ProxyConfig(model_dir="unused", **config)  # type: ignore[arg-type]
    return Dispatcher(cfg, cluster, WorkerClient(1.0), cost, vclock, ProxyMetrics())


def test_no_workers_is_503_and_overload_is_429(vclock: VirtualClock) -> None:
    d = dispatcher(vclock, ttft_slo_s=0.5)
    first = d.schedule(list(range(8)), 4)
    assert isinstance(first.decision, Accepted) and first.alone
    second = d.schedule(list(range(8)), 4)
    assert not second.alone
    with pytest.raises(ApiError) as exc:
        d.schedule(list(range(8)), 4)
    assert exc.value.status == 429 and exc.value.headers == {"Retry-After": "1"}
    assert exc.value.code == "rejected_ttft"
    d.cluster.poll_failed(D1, refused=True)
    d.cluster.poll_failed(D1, refused=True)
    with pytest.raises(ApiError) as exc:
        d.schedule(list(range(8)), 4)
    assert exc.value.status == 503


def test_prefill_times_refit_the_cost_model(vclock: VirtualClock) -> None:
    d = dispatcher(vclock, fit_cost=True)
    old = d.conductor
    for i in range(REFIT_EVERY):
        b = d.schedule(list(range(10 * (i + 1))), 2)
        d.cluster.prefill_done(b, 0.0)
        d.cluster.finish(b, 0.0)
        d.learn(b, 0, 0.01 + 0.001 * b.req.input_len)
    assert d.conductor is not old and d.conductor.cost is d.cost and d.cluster.cost is d.cost
    assert d.cost.prefill_base_s == pytest.approx(0.01, abs=1e-6)
    assert d.cost.prefill_linear_s == pytest.approx(0.001, rel=1e-3)


def test_busy_samples_and_a_fixed_cost_are_not_learned(vclock: VirtualClock) -> None:
    d = dispatcher(vclock, fit_cost=True)
    busy = d.schedule(list(range(8)), 2)
    queued = d.schedule(list(range(16)), 2)
    for _ in range(REFIT_EVERY):
        d.learn(queued, 0, 1.0)
    assert d.cost.prefill_base_s == 0.2
    fixed = dispatcher(vclock)
    b = fixed.schedule(list(range(8)), 2)
    for _ in range(REFIT_EVERY):
        fixed.learn(b, 0, 1.0)
    assert fixed.cost.prefill_base_s == 0.2 and busy.alone


def test_the_none_baseline_can_refuse_at_decode(vclock: VirtualClock) -> None:
    d = dispatcher(vclock, admission="none", tbt_slo_s=0.01)  # a decode step takes 26 ms
    b = d.schedule(list(range(8)), 2)  # arrival: only the prefill stage checks
    with pytest.raises(ApiError) as exc:
        d.check_decode(b)
    assert exc.value.status == 429 and exc.value.code == "rejected_tbt"
    assert d.metrics.rejections.labels("tbt", "decode")._value.get() == 1
    early = dispatcher(vclock, tbt_slo_s=0.01)
    with pytest.raises(ApiError, match="TBT objective"):
        early.schedule(list(range(8)), 2)  # early rejection refuses before any work


def test_a_request_no_wait_can_help_is_a_400_without_retry_after(vclock: VirtualClock) -> None:
    d = dispatcher(vclock, ttft_slo_s=0.1)  # a prefill alone is predicted at 0.2 s
    with pytest.raises(ApiError) as exc:
        d.schedule(list(range(8)), 4)  # on an idle cluster
    assert exc.value.status == 400 and exc.value.code == "slo_unreachable"
    assert not exc.value.headers and "0.200 s" in exc.value.message


def test_the_relative_slo_holds_each_request_to_its_own_unloaded_ttft(
        vclock: VirtualClock) -> None:
    d = dispatcher(vclock, ttft_slo_s=0.1, ttft_slo_relative=2.5)  # 2.5 x 0.2 s = 0.5 s
    first = d.schedule(list(range(8)), 4)  # alone: 0.2 s <= 0.5 s, whatever ttft_slo_s says
    second = d.schedule(list(range(8)), 4)  # behind one: 0.4 s
    assert first.alone and not second.alone
    with pytest.raises(ApiError) as exc:
        d.schedule(list(range(8)), 4)  # behind two: 0.6 s > 0.5 s, and waiting helps
    assert exc.value.status == 429 and exc.value.headers == {"Retry-After": "1"}
    with pytest.raises(ValueError, match="ttft_slo_relative must be > 1"):
        dispatcher(vclock, ttft_slo_relative=0.5)


def test_a_short_uncached_part_goes_straight_to_the_decode_worker(vclock: VirtualClock) -> None:
    d = dispatcher(vclock, direct_below_tokens=8, admission="none")
    p = d.cluster.view.prefill[0]
    short = d.schedule(list(range(8)), 4)
    assert short.direct and p.busy_until_s == 0.0 and p.num_queued == 1
    assert d.metrics.direct._value.get() == 1
    d.cluster.finish(short, 0.0)
    assert p.num_queued == 0
    long = d.schedule(list(range(9)), 4)
    assert not long.direct and p.busy_until_s == pytest.approx(0.2)
    off = dispatcher(vclock, admission="none")
    assert not off.schedule([1], 4).direct
