"""The proxy's /metrics text for the restart counts a supervisor keeps in a file: exact
samples, every process named, nothing for an absent or malformed file."""

from __future__ import annotations

from pathlib import Path

from kvpool.clock import VirtualClock
from kvpool.conductor import CostModel
from kvpool.serve.cluster import LiveCluster
from kvpool.serve.metrics import ProxyMetrics


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
