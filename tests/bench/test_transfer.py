"""`kvpool bench transfer`: alternating rounds, medians, ratios beside their anchors."""

from __future__ import annotations

import argparse

import pytest

from kvpool.bench.transfer import Case, goal_lines, medians, rotated, run
from kvpool.bench.transfer_peers import raw_offsets


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


def test_the_raw_anchors_batch_uses_distinct_places_as_the_engines_do() -> None:
    """A batch of the raw anchor's messages comes from (and lands in) distinct places of the
    arena, as the engines' batches read and write distinct buffers; the places start over
    where the next would not fit."""
    assert raw_offsets(1 << 20, 4, 64 << 20) == [0, 1 << 20, 2 << 20, 3 << 20]
    assert raw_offsets(16 << 20, 4, 64 << 20) == [0, 16 << 20, 32 << 20, 48 << 20]
    assert raw_offsets(16 << 20, 5, 32 << 20) == [0, 16 << 20, 0, 16 << 20, 0]
    assert raw_offsets(4096, 1, 4096) == [0]
    for size, count in ((4096, 1024), (1 << 20, 32), (16 << 20, 4)):
        offsets = raw_offsets(size, count, 64 << 20)
        assert len(set(offsets)) == count and max(offsets) + size <= 64 << 20


def test_the_raw_anchor_moves_a_batch_of_distinct_messages() -> None:
    """Through the real sink process: a batched case of 4 x 16 MiB (the whole arena) and one
    of 1,024 x 4 KiB are acknowledged, round after round."""
    from contextlib import ExitStack

    from kvpool.bench.transfer import ARENA_BYTES, raw_socket

    with ExitStack() as stack:
        call_for = raw_socket(stack, ARENA_BYTES)
        for case in (Case(16 << 20, "write", "batched"), Case(4096, "write", "batched")):
            call = call_for(case)
            for _ in range(3):
                call()
