"""Logging setup shared by every process kvpool starts."""

from __future__ import annotations

import logging
import os

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
