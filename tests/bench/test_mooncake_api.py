"""`kvpool bench mooncake-api`: ratios, and a tiny kvpool-only run end to end."""

from __future__ import annotations

import argparse
import json
import os
import socket
import struct
from collections.abc import Callable

import pytest

from kvpool.bench import anchors
from kvpool.bench import mooncake_api as bench
from kvpool.bench.common import Measurement
from kvpool.bench.mooncake_client import Phase, timed_calls
from kvpool.bench.mooncake_goals import goal_lines


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


def test_goals_judge_small_objects_against_mooncake_and_large_ones_against_the_socket() -> None:
    def row(impl: str, op: str, mode: str, size: int, gbps: float, ratio: float | None = None,
            ) -> Measurement:
        out = Measurement("mooncake-api-store", impl, "tcp", op, mode, size, gbps, 1.0)
        out.ratio = ratio
        return out
    rows = [row("kvpool", "put_from", "batched", 65536, 1.0, 1.6),
            row("kvpool", "get_into", "batched", 65536, 1.0, 1.4),
            row("kvpool", "is_exist", "batched", 65536, 0.0, 0.5),   # no goal
            row("kvpool", "get", "single", 4096, 0.1, 1.1),
            row("kvpool", "put", "single", 4096, 0.1, 1.2),
            row("kvpool", "put_from", "batched", 262144, 1.0, 0.5),  # between the two: none
            row("kvpool", "put_from", "batched", 1 << 20, 3.0, 1.8),
            row("kvpool", "get_into", "batched", 1 << 20, 3.0, 1.8),  # gets: no raw goal
            row("kvpool", "put_from", "batched", 16 << 20, 3.6, 1.7),
            row("raw-socket", "stream", "batched", 1 << 20, 4.0),
            row("raw-socket", "stream", "batched", 16 << 20, 4.0)]
    assert [line.split() for line in goal_lines(rows)] == [
        ["met", "put_from", "batched", "64", "KiB", "1.60", "x", "mooncake", ">=", "1.5"],
        ["MISS", "get_into", "batched", "64", "KiB", "1.40", "x", "mooncake", ">=", "1.5"],
        ["MISS", "get", "single", "4", "KiB", "1.10", "x", "mooncake", ">=", "1.2"],
        ["met", "put", "single", "4", "KiB", "1.20", "x", "mooncake", ">=", "1.2"],
        ["MISS", "put_from", "batched", "1", "MiB", "0.75", "x", "raw", "socket", ">=", "0.9"],
        ["met", "put_from", "batched", "16", "MiB", "0.90", "x", "raw", "socket", ">=", "0.9"]]


class Ticks:
    """A clock that moves `step` seconds each time it is read."""

    def __init__(self, step: float) -> None:
        self.now, self.step = 0.0, step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def test_a_put_takes_new_keys_up_to_the_cap_and_reads_go_over_all_of_them_again() -> None:
    phase = Phase(lambda i: f"k{i}", 3, cap=5)
    assert [phase.key(i, new=True) for i in range(6)] == ["k0", "k1", "k2", "k3", "k4", None]
    assert [phase.key(i, new=False) for i in range(7)] == \
        ["k0", "k1", "k2", "k3", "k4", "k0", "k1"]
    assert Phase(lambda i: i, 4).key(4, new=True) is None  # no cap: its keys alone


def noting(seen: list[str]) -> Callable[[str], bool]:
    """A call that notes its key and answers True."""
    def call(key: str) -> bool:
        seen.append(key)
        return True
    return call


def test_timed_calls_last_their_time_and_make_their_calls() -> None:
    seen: list[str] = []
    phase = Phase(lambda i: f"k{i}", 2, cap=100)
    calls, elapsed, failed = timed_calls(phase, noting(seen), True, 2,
                                         min_s=1.0, clock=Ticks(0.125))
    assert failed is None and elapsed >= 1.0 and calls == len(seen) > 2
    assert seen == [f"k{i}" for i in range(calls)] == phase.keys  # each put a new key
    reads: list[str] = []
    calls, _, _ = timed_calls(phase, noting(reads), False, len(phase.keys),
                              min_s=0.0, clock=Ticks(0.1))
    assert reads == phase.keys  # every key put is read, even once the time has passed


def test_a_put_out_of_new_keys_ends_its_measurement_early() -> None:
    phase = Phase(lambda i: i, 2, cap=4)
    calls, elapsed, failed = timed_calls(phase, lambda k: True, True, 2, min_s=60.0,
                                         clock=Ticks(0.1))
    assert (calls, failed) == (4, None) and elapsed < 1.0


def test_timed_calls_stop_at_the_first_wrong_answer() -> None:
    phase = Phase(lambda i: i, 10)
    calls, _, failed = timed_calls(phase, lambda k: True if k < 3 else [-704], False, 10,
                                   min_s=0.0, clock=Ticks(0.1))
    assert (calls, failed) == (3, (3, [-704]))


def test_the_raw_socket_anchor_lasts_its_minimum_time() -> None:
    import time

    with anchors.raw_socket() as raw:
        t0 = time.perf_counter()
        _, per_s = raw.round_trips(64, 3, min_s=0.2)
        took = time.perf_counter() - t0
    assert took >= 0.2 and per_s * 0.2 > 3  # more than the 3 asked for, within the time


def test_the_raw_socket_anchor_moves_more_than_its_echo_buffer() -> None:
    """16 x 16 MiB in one request, past the echo process's 64 MiB buffer (it used to spin
    on an empty view there and the bench hung); a dead echo process is an error, not a hang."""
    import threading

    done: list[tuple[float, float]] = []
    with anchors.raw_socket() as raw:
        mover = threading.Thread(target=lambda: done.append(raw.stream(16 << 20, 16, 1)),
                                 daemon=True)
        mover.start()
        mover.join(60)
    assert not mover.is_alive() and len(done) == 1 and done[0][0] > 0
    with anchors.raw_socket() as raw:
        raw.round_trips(64, 1)
        raw.sock.sendall(struct.pack("<II", 100, 8) + b"x" * 10)  # 90 bytes short, then EOF
        raw.sock.shutdown(socket.SHUT_WR)
        with pytest.raises(ConnectionError, match="closed the connection"):
            raw._reply(8)


def test_kvpool_only_run(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    bench.register(parser.add_subparsers())
    args = parser.parse_args(["mooncake-api", "--impl", "kvpool", "--sizes", "4KiB",
                              "--ops", "20", "--batch-sizes", "64KiB", "--batch", "4",
                              "--phase-bytes", "256KiB", "--dram", "16MiB", "--rounds", "2",
                              "--seconds", "0.05", "--min-seconds", "0.05", "--shm", "--json"])
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
