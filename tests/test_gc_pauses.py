"""The garbage collector's pauses, timed per generation (`kvpool.gc_pauses`)."""

from __future__ import annotations

import gc

import pytest

from kvpool.gc_pauses import BUCKETS, GcPauses


def test_each_pause_is_counted_in_its_generation_and_bucket() -> None:
    t = [10.0]
    pauses = GcPauses(now=lambda: t[0])
    for gen, pause in ((0, 0.00005), (0, 0.002), (2, 0.05), (1, 5.0)):
        pauses.on_gc("start", {"generation": gen})
        t[0] += pause
        pauses.on_gc("stop", {"generation": gen, "collected": 0, "uncollectable": 0})
    assert pauses.sums == pytest.approx([0.00205, 5.0, 0.05])
    assert pauses.counts[0][0] == 1 and pauses.counts[0][BUCKETS.index(3e-3)] == 1
    assert pauses.counts[2][BUCKETS.index(0.1)] == 1
    assert pauses.counts[1][-1] == 1  # over the last bound: +Inf
    assert sum(map(sum, pauses.counts)) == 4


def test_a_stop_without_its_start_is_not_counted() -> None:
    pauses = GcPauses(now=lambda: 1.0)
    pauses.on_gc("stop", {"generation": 0})  # added to gc.callbacks during a collection
    assert sum(map(sum, pauses.counts)) == 0 and pauses.sums == [0.0, 0.0, 0.0]


def test_the_process_pauses_are_timed_once_from_the_first_ask() -> None:
    pauses = GcPauses.installed()
    assert GcPauses.installed() is pauses and gc.callbacks.count(pauses.on_gc) == 1
    before = sum(pauses.counts[2])
    gc.collect()
    assert sum(pauses.counts[2]) == before + 1 and pauses.sums[2] > 0

