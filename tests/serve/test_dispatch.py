"""Dispatcher pieces that need no worker: rejection mapping and the online cost fit."""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import AsyncIterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpool.clock import VirtualClock
from kvpool.conductor import Accepted, CostModel
from kvpool.conductor.measured import learn_prefill
from kvpool.engine.config import SamplingParams
from kvpool.engine.worker.messages import FinishLine, PlainFrame, PrefillReply
from kvpool.serve.cluster import LiveCluster
from kvpool.serve.config import ProxyConfig
from kvpool.serve.dispatch import REFIT_EVERY, Dispatcher
from kvpool.serve.errors import ApiError
from kvpool.serve.metrics import ProxyMetrics
from kvpool.serve.requests import ChoiceJob
from kvpool.serve.responses import Choice, ChoiceRelay
from kvpool.serve.run import Run
from kvpool.serve.text import TextStream
from kvpool.serve.worker_client import WorkerClient
from tests.conductor.busy_host import BUSY_HOST
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


def learned(vclock: VirtualClock, samples: list[tuple[int, int, float]]) -> Dispatcher:
    """A dispatcher with --fit-cost over workers with room for 100,000 KV tokens that
    measured `samples`, each prefill alone on its worker (distinct prompts: nothing reused)."""
    d = dispatcher(vclock, fit_cost=True)
    for url, role in ((P1, "prefill"), (D1, "decode")):
        room = {"kv_capacity_tokens": 100_000}
        d.cluster.join(url, info(role).model_copy(update=room | {"max_model_len": 8192}))
        d.cluster.apply_load(url, load([]).model_copy(update=room | {"free_kv_tokens": 100_000}),
                             0.0)
    d.metrics.watch_cost(d.cost_in_use)
    for i, (n, _, secs) in enumerate(samples):
        b = d.schedule([10_000 * (i + 1) + t for t in range(n)], 2)
        d.cluster.prefill_done(b, 0.0)
        d.cluster.finish(b, 0.0)
        d.learn(b, 0, secs)
    return d


def test_after_learning_on_a_busy_host_long_prompts_are_not_refused(
        vclock: VirtualClock) -> None:
    d = learned(vclock, BUSY_HOST)
    # refitted when the third distinct length came (sample 18), not again since
    assert d.cost_source == "fitted"
    start = CostModel(prefill_base_s=0.2, prefill_linear_s=0.0, prefill_quadratic_s=0.0)
    assert d.cost == learn_prefill(BUSY_HOST[:18], start) and d.cluster.cost is d.cost
    for n in (900, 1024, 1400, 1900):  # the default 30 s objective, an idle cluster
        b = d.schedule([7 * n + t for t in range(n)], 16)
        assert isinstance(b.decision, Accepted) and b.alone, n
        assert b.decision.prefill.prefill_s < 30
        d.cluster.finish(b, 0.0)
    # a burst of five requests of one 1,024-token prefix: each predicted in seconds, all in
    burst = [d.schedule(list(range(1024)), 16) for _ in range(5)]
    assert all(isinstance(b.decision, Accepted) for b in burst)
    fit = d.cost.fit
    assert fit is not None and (fit.num_samples, fit.num_outliers) == (18, 1)
    assert scraped(d) == {
        ("kvpool_proxy_cost_prefill_term", ("base", "fitted")): d.cost.prefill_base_s,
        ("kvpool_proxy_cost_prefill_term", ("linear", "fitted")): d.cost.prefill_linear_s,
        ("kvpool_proxy_cost_prefill_term", ("quadratic", "fitted")): d.cost.prefill_quadratic_s,
        ("kvpool_proxy_cost_fit_residual_seconds", ()): fit.residual_s,
        ("kvpool_proxy_cost_fit_samples", ()): 18.0,
        ("kvpool_proxy_cost_fit_outliers", ()): 1.0,
        ("kvpool_proxy_cost_longest_context_tokens", ()): 158.0,
        ("kvpool_proxy_cost_refits_total", ()): 1.0}


def scraped(d: Dispatcher) -> dict[tuple[str, tuple[str, ...]], float]:
    """The cost model's series of the dispatcher's /metrics text: (name, (term, model))."""
    text = d.metrics.render().decode()
    return {(s.name, tuple(s.labels[k] for k in ("term", "model") if k in s.labels)): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name.startswith("kvpool_proxy_cost_") and not s.name.endswith("_created")}


def test_a_refusal_says_which_cost_model_predicted_what(vclock: VirtualClock) -> None:
    d = learned(vclock, BUSY_HOST)
    d.cluster.view.prefill[0].busy_until_s = 29.0  # 29 s queued ahead: waiting helps
    with pytest.raises(ApiError) as exc:
        d.schedule(list(range(1500)), 4)
    err = exc.value
    assert (err.status, err.code) == (429, "rejected_ttft")
    assert err.log_note.startswith(f"cost=fitted base={d.cost.prefill_base_s:.4g}s ")
    assert "samples=18 outliers=1 longest=158 prefill=3.696s" in err.log_note
    assert err.log_note in err.message
    fixed = dispatcher(vclock, ttft_slo_s=0.1)
    fixed.metrics.watch_cost(fixed.cost_in_use)
    assert scraped(fixed) == {
        ("kvpool_proxy_cost_prefill_term", ("base", "default")): 0.2,
        ("kvpool_proxy_cost_prefill_term", ("linear", "default")): 0.0,
        ("kvpool_proxy_cost_prefill_term", ("quadratic", "default")): 0.0,
        ("kvpool_proxy_cost_refits_total", ()): 0.0}
    with pytest.raises(ApiError) as exc:
        fixed.schedule(list(range(8)), 4)
    assert exc.value.code == "slo_unreachable"
    assert exc.value.log_note == ("cost=default base=0.2s linear=0s/tok quadratic=0s/tok2 "
                                  "prefill=0.200s")


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


def test_a_direct_requests_first_token_moves_no_prefill_queue(vclock: VirtualClock) -> None:
    """Its prefill ends with the decode worker's first token: that time says nothing of the
    prefill worker's queue, which is not shifted by it (the request before still prefills
    until 0.2 s)."""
    d = dispatcher(vclock, direct_below_tokens=64, admission="none")
    queued = d.schedule(list(range(100)), 4)
    p = queued.prefill_load
    assert not queued.direct and p.busy_until_s == pytest.approx(0.2)
    short = d.schedule(list(range(1000, 1008)), 4)
    assert short.direct
    vclock.advance(0.01)
    d.cluster.prefill_done(short, vclock.now())  # at its first token
    assert p.busy_until_s == pytest.approx(0.2) and p.num_queued == 1


def test_a_run_whose_text_its_decode_legs_make_moves_only_to_a_worker_that_makes_text(
        vclock: VirtualClock) -> None:
    """After its decode worker fails, a run that relays its decode legs' SSE text goes on
    on a worker whose /info says it makes text (sse_text), never on one that would refuse
    the request or leave the client without the text; a run whose text the proxy makes goes
    on on either."""
    from kvpool.engine.worker.messages import SseSpec

    d = dispatcher(vclock)
    texts = info("decode").model_copy(update={"sse_text": True})
    for url, reply in (("http://d2", info("decode")), ("http://d3", texts)):
        d.cluster.add(url)
        d.cluster.join(url, reply)
        d.cluster.apply_load(url, load([]), 0.0)
    failed = d.cluster.workers[D1]
    plain = Run(d, d.schedule(list(range(8)), 2), "a", list(range(8)), SamplingParams())
    relayed = Run(d, d.schedule(list(range(8)), 2), "b", list(range(8)), SamplingParams())
    relayed.sse = SseSpec(kind="completion", id="cmpl-b", model="m")
    assert {w.url for w in d.cluster.alive(("decode",))} >= {"http://d2", "http://d3"}
    got = relayed._next_decode(failed)
    assert got is not None and got.url == "http://d3"
    assert relayed._next_decode(got) is None  # d2 cannot make its text
    assert plain._next_decode(failed) is not None


def test_a_relayed_run_is_freed_when_its_legs_end(vclock: VirtualClock) -> None:
    """A run whose frames a ChoiceRelay takes (`relay_chunk`) lets go of it once its legs
    end: the run, its choice and the relay (which holds the client's connection) go when the
    request does, not at the cyclic collector's next pass."""
    d = dispatcher(vclock)

    async def prefill(url: str, req: object) -> PrefillReply:
        return PrefillReply(request_id="r", first_token_id=7, num_prompt_tokens=8,
                            num_cached_tokens=0, num_pool_tokens=0, kv_bytes_moved=0)

    async def generate(url: str, req: object,
                       relay: object = None) -> AsyncIterator[PlainFrame | FinishLine]:
        yield PlainFrame([7, 8], [1.0, 1.0])
        yield FinishLine(finish_reason="length", num_output_tokens=2)

    d.client.prefill = prefill  # type: ignore[method-assign]
    d.client.generate = generate  # type: ignore[method-assign,assignment]
    prompt = list(range(8))

    async def go() -> weakref.ref[Run]:
        run = Run(d, d.schedule(prompt, 2), "r", prompt, SamplingParams(max_tokens=2))
        relay = run.relay_chunk = ChoiceRelay(d.metrics)
        stream = run.chunks()
        relay.choice = Choice(ChoiceJob(0, 0, prompt, SamplingParams(max_tokens=2)), run,
                              await anext(stream), stream, TextStream(str))
        assert [ids async for ids in stream] == [[8]]
        assert run.relay_chunk is None
        return weakref.ref(run)

    gc.disable()
    try:
        freed = asyncio.run(go())
        assert freed() is None, "kept alive by a reference cycle"
    finally:
        gc.enable()
