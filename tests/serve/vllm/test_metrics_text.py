"""vLLM's /metrics text read into the conductor's load: both KV-usage names, data-parallel
engines summed, cache_config_info's labels, and a text that is not a vLLM's."""

# NEW is a server of two data-parallel engines of 100 blocks each, as vLLM renders it: its
# API server adds the engines' blocks into one cache config (v1/engine/core_client.py) and
# writes that config into each engine's cache_config_info series (v1/metrics/loggers.py).

from __future__ import annotations

from kvpool.serve.vllm.metrics_text import METRICS_PATH, EngineMetrics, parse_metrics

NEW = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
vllm:num_requests_waiting{engine="0",model_name="m"} 4.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.25
vllm:cache_config_info{block_size="128",cache_dtype="auto",engine="0",num_gpu_blocks="200",prefix_caching_hash_algo="sha256_cbor"} 1.0
vllm:cache_config_info{block_size="128",cache_dtype="auto",engine="1",num_gpu_blocks="200",prefix_caching_hash_algo="sha256_cbor"} 1.0
vllm:prompt_tokens_total{engine="0",model_name="m"} 1.2e+04
"""

OLD = """\
vllm:num_requests_running{model_name="m"} 1.0
vllm:num_requests_waiting{model_name="m"} 2.0
vllm:gpu_cache_usage_perc{model_name="m"} 0.75
"""


def test_new_names_are_summed_over_engines() -> None:
    m = parse_metrics(NEW)
    assert m == EngineMetrics(num_running=5, num_waiting=4, kv_usage=0.375, block_size=128,
                              num_gpu_blocks=200, hash_algo="sha256_cbor")
    assert m.kv_capacity_tokens == 25600


def test_samples_that_are_not_finite_counts_are_read_as_absent() -> None:
    """NaN and infinities (prometheus_client renders them) and a label that is not a decimal
    count are absent, never an exception out of a poll."""
    odd = NEW.replace('{engine="1",model_name="m"} 2.0', '{engine="1",model_name="m"} NaN')
    odd = odd.replace('{engine="0",model_name="m"} 4.0', '{engine="0",model_name="m"} +Inf')
    m = parse_metrics(odd.replace('num_gpu_blocks="200"', 'num_gpu_blocks="\u00b9"'))
    assert m == EngineMetrics(num_running=3, num_waiting=0, kv_usage=0.375, block_size=128,
                              num_gpu_blocks=None, hash_algo="sha256_cbor")
    assert parse_metrics("vllm:num_requests_running NaN\n") is None


def test_the_older_usage_name_and_no_cache_info() -> None:
    m = parse_metrics(OLD)
    assert m == EngineMetrics(num_running=1, num_waiting=2, kv_usage=0.75)
    assert m.kv_capacity_tokens is None


def test_a_text_without_vllm_samples_is_not_a_vllm() -> None:
    assert parse_metrics("# HELP x\nkvpool_proxy_requests_total 3\nprocess_cpu 1.5\n") is None
    assert parse_metrics("") is None


def test_the_scrape_asks_prometheus_for_the_names_read_only() -> None:
    """vLLM serves /metrics with prometheus_client's ASGI app: METRICS_PATH's `name[]` filter
    leaves the five samples parsed and drops the rest (a histogram here)."""
    import asyncio

    import httpx
    from prometheus_client import CollectorRegistry, Gauge, Histogram, make_asgi_app

    registry = CollectorRegistry()
    Gauge("vllm:num_requests_running", "", ["engine"], registry=registry).labels("0").set(3)
    Gauge("vllm:num_requests_waiting", "", ["engine"], registry=registry).labels("0").set(2)
    Gauge("vllm:kv_cache_usage_perc", "", ["engine"], registry=registry).labels("0").set(0.25)
    info = Gauge("vllm:cache_config_info", "", ["block_size", "num_gpu_blocks"],
                 registry=registry)
    info.labels("128", "40").set(1)
    Histogram("vllm:time_to_first_token_seconds", "", registry=registry).observe(0.5)

    async def scrape(path: str) -> str:
        transport = httpx.ASGITransport(app=make_asgi_app(registry=registry))
        async with httpx.AsyncClient(transport=transport, base_url="http://vllm") as client:
            return (await client.get(path)).text

    whole, filtered = asyncio.run(scrape("/")), asyncio.run(scrape(METRICS_PATH[len("/metrics"):]))
    assert "time_to_first_token" in whole and "time_to_first_token" not in filtered
    assert parse_metrics(filtered) == parse_metrics(whole) == EngineMetrics(
        num_running=3, num_waiting=2, kv_usage=0.25, block_size=128, num_gpu_blocks=40)
