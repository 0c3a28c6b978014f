"""Mooncake-format request traces: one JSON object per line with `timestamp` (ms),
`input_length`, `output_length` and `hash_ids` (one prefix-chained id per 512-token block)."""

from __future__ import annotations

import gzip
import json
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from kvpool.conductor.types import RequestInfo
from kvpool.errors import InvalidArgument

TRACE_NAME = "conversation_trace.jsonl"
PACKAGED_TRACE = Path(__file__).resolve().parents[1] / "data" / (TRACE_NAME + ".gz")
"""The trace shipped inside the package (gzipped; source and licence in kvpool/data/README.md)."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    request_id: int
    arrival_s: float
    input_len: int
    output_len: int
    block_hashes: tuple[int, ...]

    def info(self) -> RequestInfo:
        return RequestInfo(self.request_id, self.input_len, self.output_len, self.block_hashes)


def default_trace_path() -> Path:
    """`$KVPOOL_TRACE_DIR/conversation_trace.jsonl`, else the copy packaged with kvpool, else
    `../shared/data/traces/` beside the project's root (a checkout without the package data)."""
    env = os.environ.get("KVPOOL_TRACE_DIR")
    if env:
        return Path(env) / TRACE_NAME
    if PACKAGED_TRACE.is_file():
        return PACKAGED_TRACE
    return checkout_trace_path()


def checkout_trace_path(name: str = TRACE_NAME) -> Path:
    root = Path(__file__).resolve().parents[3]
    return (root / ".." / "shared" / "data" / "traces" / name).resolve()


def named_trace_path(name: str) -> Path:
    """The trace file `name` of the paper's workloads: the conversation trace as
    `default_trace_path`; any other (synthetic_trace.jsonl) from `$KVPOOL_TRACE_DIR`, else
    from `../shared/data/traces/` beside the project's root."""
    if name == TRACE_NAME:
        return default_trace_path()
    env = os.environ.get("KVPOOL_TRACE_DIR")
    return Path(env) / name if env else checkout_trace_path(name)


def _parse(line: str, lineno: int, path: Path) -> tuple[float, int, int, tuple[int, ...]]:
    try:
        obj = json.loads(line)
        ts = float(obj["timestamp"]) / 1000.0
        n, out = int(obj["input_length"]), int(obj["output_length"])
        hashes = tuple(int(h) for h in obj.get("hash_ids", ()))
    except (ValueError, KeyError, TypeError) as exc:
        raise InvalidArgument(f"{path}:{lineno}: not a Mooncake trace record ({exc})") from None
    if n <= 0 or out < 0 or ts < 0:
        raise InvalidArgument(
            f"{path}:{lineno}: need input_length > 0, output_length >= 0, timestamp >= 0")
    return ts, n, out, hashes


def load_trace(path: Path | str | None = None, limit: int | None = None) -> list[TraceRequest]:
    """Read a trace (plain or .gz); arrival times are relative to the first record. Raises InvalidArgument on a
    missing file or a malformed line (with its number)."""
    p = Path(path) if path is not None else default_trace_path()
    if not p.is_file():
        raise InvalidArgument(f"trace file not found: {p} (give --trace FILE or KVPOOL_TRACE_DIR)")
    out: list[TraceRequest] = []
    with (gzip.open(p, "rt") if p.suffix == ".gz" else p.open()) as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            if limit is not None and len(out) >= limit:
                break
            ts, n, o, hashes = _parse(line, lineno, p)
            out.append(TraceRequest(len(out), ts, n, o, hashes))
    if not out:
        raise InvalidArgument(f"trace {p} has no records")
    origin = min(r.arrival_s for r in out)
    return sorted((replace(r, arrival_s=r.arrival_s - origin) for r in out),
                  key=lambda r: (r.arrival_s, r.request_id))


def speed_up(reqs: Sequence[TraceRequest], factor: float) -> list[TraceRequest]:
    """Replay `factor` times faster (2.0 halves every timestamp)."""
    if factor <= 0:
        raise InvalidArgument(f"speed-up factor must be > 0, got {factor}")
    return [replace(r, arrival_s=r.arrival_s / factor) for r in reqs]


def poisson_arrivals(reqs: Sequence[TraceRequest], rate_per_s: float,
                     seed: int = 0) -> list[TraceRequest]:
    """Same requests in the same order, with exponential inter-arrival gaps at `rate_per_s`."""
    if rate_per_s <= 0:
        raise InvalidArgument(f"arrival rate must be > 0, got {rate_per_s}")
    rng = random.Random(seed)
    t = 0.0
    out = []
    for r in reqs:
        out.append(replace(r, arrival_s=t))
        t += rng.expovariate(rate_per_s)
    return out


def force_output_len(reqs: Sequence[TraceRequest], output_len: int) -> list[TraceRequest]:
    return [replace(r, output_len=output_len) for r in reqs]
