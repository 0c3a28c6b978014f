"""Removal of /dev/shm files left behind by engines whose process died (e.g. kill -9)."""

from __future__ import annotations

import os

from kvpool.transfer.memory import SHM_NAME as _NAME
from kvpool.transfer.segment import pid_exists


def sweep_stale_shm(directory: str = "/dev/shm") -> int:
    """Unlink managed-buffer files whose owning pid no longer exists; returns how many."""
    removed = 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    for name in names:
        match = _NAME.match(name)
        if match is None or pid_exists(int(match.group(1))):
            continue
        try:
            os.unlink(os.path.join(directory, name))
            removed += 1
        except OSError:
            pass
    return removed

