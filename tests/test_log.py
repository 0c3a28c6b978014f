"""kvpool.log.RateLimitedLog: one line per interval, with the count of those left out."""

from __future__ import annotations

import logging

import pytest

from kvpool.log import RateLimitedLog


def test_rate_limited_log_counts_what_it_leaves_out(caplog: pytest.LogCaptureFixture) -> None:
    now = [100.0]
    limited = RateLimitedLog(logging.getLogger("kvpool.test"), 5.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="kvpool.test"):
        for t in (100.0, 101.0, 104.9, 105.0, 106.0, 200.0):
            now[0] = t
            limited.warn("accept failed (%s)", "EMFILE")
    assert [r.getMessage() for r in caplog.records] == [
        "accept failed (EMFILE)",
        "accept failed (EMFILE) (2 more like it in the last 5s)",
        "accept failed (EMFILE) (1 more like it in the last 5s)"]
