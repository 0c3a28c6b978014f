"""A client's counters under threads that share it: no count is lost."""

from __future__ import annotations

import sys
import threading

from kvpool.store.client.types import ClientStats


def test_counts_added_from_many_threads_all_count() -> None:
    stats = ClientStats()
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch as often as they can: a lost count shows

    def count() -> None:
        for _ in range(20_000):
            stats.add(early_reads=1, early_reads_refused=2)
    try:
        threads = [threading.Thread(target=count) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(before)
    assert (stats.early_reads, stats.early_reads_refused) == (80_000, 160_000)
    assert stats.checksum_mismatches == 0 and "lock" not in repr(stats)
