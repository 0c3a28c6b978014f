"""The speed goals of `kvpool bench mooncake-api`, judged on the medians of one run: the
store's small objects against the real Mooncake wheel, its large ones against the raw
loopback socket measured in the same rounds (docs/perf.md).

    batched calls of 4-64 KiB objects: put_from and get_into >= 1.5x Mooncake
    single keys of 4-64 KiB: put_from, get_into, put and get >= 1.2x Mooncake
    batched calls of 1-16 MiB objects: put_from >= 0.9x the raw socket
"""

from __future__ import annotations

from kvpool.bench.common import Measurement, goal_line
from kvpool.units import format_size

SMALL = range(4 << 10, (64 << 10) + 1)
LARGE = range(1 << 20, (16 << 20) + 1)
BATCHED_X_MOONCAKE = 1.5
SINGLE_X_MOONCAKE = 1.2
LARGE_X_RAW = 0.9


def goal_lines(results: list[Measurement]) -> list[str]:
    """A line per goal the run measured (kvpool rows carry their kv/mc `ratio`)."""
    ours = {(m.op, m.mode, m.size_bytes): m for m in results
            if m.impl == "kvpool" and m.bench == "mooncake-api-store"}
    raw = {m.size_bytes: m for m in results if m.impl == "raw-socket" and m.mode == "batched"}
    lines = []
    for (op, mode, size), m in ours.items():
        if size in SMALL and m.ratio is not None and (
                (mode == "batched" and op in ("put_from", "get_into"))
                or (mode == "single" and op in ("put_from", "get_into", "put", "get"))):
            need = BATCHED_X_MOONCAKE if mode == "batched" else SINGLE_X_MOONCAKE
            lines.append(goal_line(m.ratio >= need, f"{op} {mode} {format_size(size)} "
                                   f"{m.ratio:.2f} x mooncake >= {need}"))
        elif mode == "batched" and op == "put_from" and size in LARGE and size in raw \
                and raw[size].gb_per_s > 0:
            x = m.gb_per_s / raw[size].gb_per_s
            lines.append(goal_line(x >= LARGE_X_RAW, f"{op} {mode} {format_size(size)} "
                                   f"{x:.2f} x raw socket >= {LARGE_X_RAW}"))
    return lines
