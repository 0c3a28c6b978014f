"""Parsing and printing of sizes ("16MB", "4gb", "8GiB") and durations."""

from __future__ import annotations

import re

from kvpool.errors import ConfigError

_UNITS = {
    "": 1, "b": 1,
    "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10,
    "m": 1 << 20, "mb": 1 << 20, "mib": 1 << 20,
    "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30,
    "t": 1 << 40, "tb": 1 << 40, "tib": 1 << 40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | float | str) -> int:
    """Bytes from an int or a string such as "16MB", "4gb", "8GiB" (binary multiples).

    Percentages and negative values are refused with ConfigError.
    """
    if isinstance(value, bool):
        raise ConfigError(f"size must be a number of bytes or a string like '16MB', got {value!r}")
    if isinstance(value, int | float):
        if value < 0:
            raise ConfigError(f"size must be >= 0, got {value}")
        return int(value)
    match = _SIZE_RE.match(str(value))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ConfigError(f"cannot parse size {value!r}: use bytes or a unit like '16MB', '4GiB'")
    return int(float(match.group(1)) * _UNITS[unit])


def format_size(num_bytes: float) -> str:
    """Human-readable binary size: 4096 -> '4 KiB', 1.5*2**20 -> '1.5 MiB'."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if num_bytes >= scale:
            value = num_bytes / scale
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"
    return f"{int(num_bytes)} B"
