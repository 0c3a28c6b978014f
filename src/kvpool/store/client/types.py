"""Types the store client's base and its read path share (kept apart so that neither module
imports the other)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ClientStats:
    """Counters of one client (read them any time; they only grow)."""

    checksum_mismatches: int = 0
    """Replica reads whose bytes did not match the object's checksum (refused)."""
    damaged_dropped: int = 0
    """Of those, replicas the master dropped from the pool on this client's report."""
    remounts: int = 0
    """Times the master had forgotten this client and its segments were mounted again."""
    early_reads: int = 0
    """Single-key reads of a small object from the place its last lookup named, sent while
    the master answered a new lookup (store/client/early.py)."""
    early_reads_refused: int = 0
    """Of those, reads the master's answer did not vouch for (read again the ordinary way)."""
