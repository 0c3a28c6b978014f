"""The proxy's /metrics text for the restart counts a supervisor keeps in a file: exact
samples, every process named, nothing for an absent or malformed file."""

from __future__ import annotations

from pathlib import Path

from kvpool.clock import VirtualClock
from kvpool.conductor import CostModel
from kvpool.serve.cluster import LiveCluster
from kvpool.serve.metrics import ProxyMetrics
from kvpool.serve.samples import MeasuredSamples


def restart_lines(path: Path) -> list[str]:
    metrics = ProxyMetrics()
    metrics.watch(LiveCluster(CostModel(), VirtualClock()), str(path))
    return [line for line in metrics.render().decode().splitlines()
            if line.startswith("kvpool_up_restarts")]


def test_restart_counts_from_the_supervisors_file(tmp_path: Path) -> None:
    path = tmp_path / "restarts.json"
    assert restart_lines(path) == []  # no file yet
    path.write_text('{"decode-1": 2, "master": 0}')
    assert restart_lines(path) == ['kvpool_up_restarts_total{process="decode-1"} 2.0',
                                   'kvpool_up_restarts_total{process="master"} 0.0']
    path.write_text('{"decode-1": 3')  # half a file (the supervisor replaces it whole)
    assert restart_lines(path) == []
    path.write_text('[1, 2]')
    assert restart_lines(path) == []
    path.write_text('{"proxy": 1, "odd": "x"}')
    assert restart_lines(path) == ['kvpool_up_restarts_total{process="proxy"} 1.0']


def test_no_restart_metric_without_a_file() -> None:
    metrics = ProxyMetrics()
    metrics.watch(LiveCluster(CostModel(), VirtualClock()))
    assert b"kvpool_up_restarts" not in metrics.render()


def test_loop_histogram_and_counter_read_as_prometheus_clients_do() -> None:
    """The lock-free TBT histogram and output-token counter expose the same samples as
    prometheus_client's Histogram and Counter given the same updates."""
    from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

    from kvpool.serve.metrics import _TBT_BUCKETS

    reg = CollectorRegistry()
    ref_tbt = Histogram("kvpool_proxy_tbt_seconds", "Time between output tokens", registry=reg,
                        buckets=_TBT_BUCKETS)
    ref_out = Counter("kvpool_proxy_output_tokens", "Tokens generated", registry=reg)
    ours = ProxyMetrics()
    for value in (0.0, 0.0005, 0.001, 0.0010001, 0.003, 0.7, 2.5, 9.0):  # bounds and beyond
        ref_tbt.observe(value)
        ours.tbt.observe(value)
    ref_out.inc(7)
    ours.output_tokens.inc(3)
    ours.output_tokens.inc(4)

    def lines(text: bytes) -> list[str]:
        return [line for line in text.decode().splitlines() if "_created" not in line
                and ("kvpool_proxy_tbt" in line or "kvpool_proxy_output" in line)]
    assert lines(ours.render()) == lines(generate_latest(reg))
    assert 'kvpool_proxy_tbt_seconds_bucket{le="0.001"} 3.0' in lines(ours.render())


def test_a_frame_of_several_tokens_is_a_decode_sample_per_token() -> None:
    """A merged frame's gap is shared among its tokens: as many samples as frames of one
    token would give, counted, and bounded as the rest."""
    samples = MeasuredSamples(max_samples=5)
    samples.add_decode(2, 100, 0.01)
    samples.add_decode(3, 120, 0.004, 3)
    assert list(samples.decode) == [(2, 100, 0.01)] + [(3, 120, 0.004)] * 3
    samples.add_decode(3, 130, 0.002, 4)
    assert samples.num_decode == 8 and len(samples.decode) == 5
    assert samples.to_json()["decode"][-1] == [3, 130, 0.002]
