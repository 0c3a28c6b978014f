"""Types the store client's base and its read path share (kept apart so that neither module
imports the other)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass
class ClientStats:
    """Counters of one client (read them any time; they only grow). Several threads share a
    client (a connector's, a worker's transfer threads): counts go through `add`, under a lock
    (`x += n` on an attribute is a read and a write, and a thread switch between them loses
    the other thread's count)."""

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
    lease_retries: int = 0
    """Objects looked up and read again because their read lease ended before the read did
    (ClientConfig.lease_retries)."""
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False,
                                  compare=False)

    def add(self, **counts: int) -> None:
        """Add to the named counters."""
        with self._lock:
            for name, n in counts.items():
                setattr(self, name, getattr(self, name) + n)
