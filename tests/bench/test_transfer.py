"""`kvpool bench transfer`: alternating rounds, medians, ratios beside their anchors."""

from __future__ import annotations

import argparse

import pytest

from kvpool.bench.transfer import Case, goal_lines, medians, rotated, run


def test_rounds_rotate_the_order_of_implementations() -> None:
    names = [("kvpool", "tcp"), ("mooncake", "tcp"), ("raw-socket", "tcp")]
    assert [rotated(names, r)[0] for r in range(4)] == [names[0], names[1], names[2], names[0]]


def test_medians_and_ratios_come_from_the_same_run() -> None:
    small = Case(4096, "read", "single")
    samples = {
        (("kvpool", "tcp"), small): [(1.0, 100.0), (9.0, 900.0), (2.0, 200.0)],
        (("mooncake", "tcp"), small): [(4.0, 400.0), (1.0, 100.0), (0.5, 50.0)],
        (("raw-socket", "tcp"), small): [(8.0, 800.0), (8.0, 800.0), (8.0, 800.0)],
    }
    rows = {m.impl: m for m in medians(samples, [small])}
    assert rows["kvpool"].gb_per_s == 2.0 and rows["kvpool"].req_per_s == 200.0
    assert rows["kvpool"].anchor == "mooncake" and rows["kvpool"].ratio == 2.0
    assert rows["mooncake"].anchor == "raw-socket" and rows["mooncake"].ratio == 0.125
    assert goal_lines(list(rows.values())) == [
        "  met   tcp 4 KiB read round trip 5000 us <= mooncake 10000 us"]


def test_a_short_run_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    args = argparse.Namespace(quick=True, sizes="4096,131072", transports="tcp,shm", no_mooncake=True,
                              seconds=0.01, rounds=2, json=False)
    assert run(args) == 0
    out = capsys.readouterr().out
    assert "median of 2 alternating rounds" in out
    assert "kvpool tcp" in out and "raw socket" in out and "memcpy" in out
    assert "128 KiB read  batched" in out
