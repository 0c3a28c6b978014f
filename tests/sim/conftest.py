"""Factories for simulator tests: traces written to real files, and the round-number cost model."""

from __future__ import annotations

import json
from pathlib import Path

from kvpool.sim.trace import TraceRequest, load_trace
from tests.conductor.conftest import SIMPLE_COST

__all__ = ["SIMPLE_COST", "write_trace", "trace_of"]


def write_trace(path: Path, rows: list[tuple[float, int, int, list[int]]]) -> Path:
    """rows: (timestamp_s, input_len, output_len, hash_ids) -> Mooncake JSONL at `path`."""
    with path.open("w") as fh:
        for ts, n, out, hashes in rows:
            fh.write(json.dumps({"timestamp": int(round(ts * 1000)), "input_length": n,
                                 "output_length": out, "hash_ids": hashes}) + "\n")
    return path


def trace_of(tmp_path: Path, rows: list[tuple[float, int, int, list[int]]]) -> list[TraceRequest]:
    return load_trace(write_trace(tmp_path / "trace.jsonl", rows))
