"""Logging setup shared by every process kvpool starts."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

_FORMAT = "%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s"


def get_logger(name: str) -> logging.Logger:
    return logging.getLogger(name if name.startswith("kvpool") else f"kvpool.{name}")


def setup_logging(level: str | None = None) -> None:
    """Configure the root kvpool logger once; `KVPOOL_LOG_LEVEL` overrides the default INFO."""
    chosen = (level or os.environ.get("KVPOOL_LOG_LEVEL") or "INFO").upper()
    logging.basicConfig(level=chosen, format=_FORMAT)
    logging.getLogger("kvpool").setLevel(chosen)
    for noisy in ("httpx", "httpcore"):  # one INFO line per HTTP request otherwise
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLogger("kvpool").level))


class RateLimitedLog:
    """Warnings that may repeat many times a second, logged at most once per interval with
    the count of those left out."""

    def __init__(self, logger: logging.Logger, interval_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._log, self.interval_s = logger, interval_s
        self._clock = clock
        self._last_s: float | None = None
        self._suppressed = 0

    def warn(self, message: str, *args: object, exc_info: bool = False) -> None:
        """Log `message % args` as a warning, unless one was logged within the interval
        (then it is only counted, and the count is added to the next one logged)."""
        now = self._clock()
        if self._last_s is not None and now - self._last_s < self.interval_s:
            self._suppressed += 1
            return
        if self._suppressed:
            message += f" ({self._suppressed} more like it in the last {self.interval_s:g}s)"
        self._log.warning(message, *args, exc_info=exc_info)
        self._last_s, self._suppressed = now, 0
