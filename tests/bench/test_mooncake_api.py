"""`kvpool bench mooncake-api`: ratios, and a tiny kvpool-only run end to end."""

from __future__ import annotations

import argparse
import json
import os

import pytest

from kvpool.bench import mooncake_api as bench
from kvpool.bench.common import Measurement


def m(impl: str, op: str, gbps: float, reqs: float, mode: str = "batched") -> Measurement:
    return Measurement("mooncake-api-store", impl, "tcp", op, mode, 4096, gbps, reqs)


def test_ratios_are_kvpool_over_mooncake() -> None:
    rows = [m("kvpool", "put", 2.0, 10), m("mooncake", "put", 1.0, 5),
            m("kvpool", "is_exist", 0.0, 300), m("mooncake", "is_exist", 0.0, 100),
            m("kvpool", "get", 1.0, 1), m("kvpool-shm", "put", 4.0, 20),
            m("kvpool", "put", 0.1, 30, "single")]
    bench.add_ratios(rows)
    assert [(r.ratio, r.anchor) for r in rows] == [
        (2.0, "mooncake"), (None, None), (3.0, "mooncake"), (None, None), (None, None),
        (4.0, "mooncake"), (None, None)]


def test_medians_of_rounds() -> None:
    rows = [m("kvpool", "put", g, r) for g, r in ((1.0, 5), (3.0, 1), (2.0, 9))]
    assert [(x.gb_per_s, x.req_per_s) for x in bench.medians(rows)] == [(2.0, 5)]


def test_ratios_within_each_round(capsys: pytest.CaptureFixture[str]) -> None:
    rounds = [[m("kvpool", "put", 2.0, 10), m("mooncake", "put", 1.0, 5),
               m("kvpool", "is_exist", 0.0, 300), m("mooncake", "is_exist", 0.0, 100),
               m("kvpool-shm", "put", 9.0, 10), m("raw-socket", "put", 3.0, 1)],
              [m("kvpool", "put", 3.0, 10), m("mooncake", "put", 4.0, 5),
               m("kvpool", "is_exist", 0.0, 200), m("mooncake", "is_exist", 0.0, 100)],
              [m("kvpool", "put", 1.0, 10), m("mooncake", "put", 1.0, 5)]]
    ratios = bench.round_ratios(rounds)
    assert ratios == {("put", "batched", 4096): [2.0, 0.75, 1.0],
                      ("is_exist", "batched", 4096): [3.0, 2.0]}
    bench.print_spread(ratios)
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2].split() == ["put", "batched", "4", "KiB", "0.75", "1.00", "2.00"]


def test_kvpool_only_run(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    bench.register(parser.add_subparsers())
    args = parser.parse_args(["mooncake-api", "--impl", "kvpool", "--sizes", "4KiB",
                              "--ops", "20", "--batch-sizes", "64KiB", "--batch", "4",
                              "--phase-bytes", "256KiB", "--dram", "16MiB", "--rounds", "2",
                              "--seconds", "0.05", "--shm", "--json"])
    assert args.func(args) == 0
    rows = [Measurement(**json.loads(line)) for line in capsys.readouterr().out.splitlines()]
    ours = [(r.op, r.mode, r.size_bytes) for r in rows if r.impl == "kvpool"]
    assert ours == [(op, "single", 4096) for op in ("put_from", "get_into", "put", "get",
                                                     "is_exist")] + [
        (op, "batched", 65536) for op in ("put_from", "get_into", "is_exist", "write",
                                           "read")]
    shm = [(r.op, r.mode) for r in rows if r.impl == "kvpool-shm"]
    assert shm == [(op, mode) for op, mode, _ in ours[:8]]  # the engine phase: tcp only
    anchors = {(r.impl, r.op, r.mode) for r in rows if r.impl in ("raw-socket", "memcpy")}
    assert anchors == {("raw-socket", "round_trip", "single"),
                       ("raw-socket", "stream", "batched"), ("memcpy", "copy", "batched")}
    assert all(r.req_per_s > 0 for r in rows)


def test_cpu_bench_reports_each_op_with_every_process_cpu(
        capsys: pytest.CaptureFixture[str]) -> None:
    from kvpool.bench import mooncake_cpu as bench_cpu
    parser = argparse.ArgumentParser()
    bench_cpu.register(parser.add_subparsers())
    args = parser.parse_args(["mooncake-cpu", "--impl", "kvpool", "--ops", "50"])
    assert args.func(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:6] == ["impl", "op", "wall", "us", "client", "master"]
    assert lines[-1].startswith("raw-tcp")
    rows = [line.split() for line in lines[1:-1]]
    assert [r[:2] for r in rows] == [["kvpool", op] for op in
                                     ("is_exist", "get", "put", "get_into", "put_from")]
    for row in rows:
        assert float(row[2]) > 0
        assert all(len(col.split("/")) == 2 for col in row[3:6])
    assert bench_cpu.cpu_times(os.getpid())[0] > 0


@pytest.mark.slow  # 5 s: a master and a node of its own; the single-key case stays in the default suite
def test_cpu_bench_runs_batched_calls(capsys: pytest.CaptureFixture[str]) -> None:
    from kvpool.bench import mooncake_cpu as bench_cpu
    parser = argparse.ArgumentParser()
    bench_cpu.register(parser.add_subparsers())
    args = parser.parse_args(["mooncake-cpu", "--impl", "kvpool", "--ops", "20",
                              "--size", "64KiB", "--batch", "8"])
    assert args.func(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "8 x 65536 B per call" in lines[0]
    rows = [line.split() for line in lines[1:-1]]
    assert [r[:2] for r in rows] == [["kvpool", op] for op in
                                     ("batch_is_exist", "batch_get_into", "batch_put_from")]
    assert all(float(r[2]) > 0 for r in rows)
