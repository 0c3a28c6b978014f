"""Removal of /dev/shm files left behind by engines whose process died (e.g. kill -9).

A file's pid is judged only when the file was made in our own pid namespace: a container that
shares /dev/shm but not our pid namespace has pids that mean nothing here (a live engine there
could look dead, or a dead one alive), so its files are left alone.
"""

from __future__ import annotations

import os

from kvpool.transfer.memory import SHM_NAME as _NAME
from kvpool.transfer.memory import pid_namespace
from kvpool.transfer.segment import pid_exists


def sweep_stale_shm(directory: str = "/dev/shm") -> int:
    """Unlink managed-buffer files of our pid namespace whose owning pid no longer exists;
    returns how many."""
    removed, namespace = 0, f"{pid_namespace():x}"
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    for name in names:
        match = _NAME.match(name)
        if match is None or match.group(2) != namespace or pid_exists(int(match.group(1))):
            continue
        try:
            os.unlink(os.path.join(directory, name))
            removed += 1
        except OSError:
            pass
    return removed

