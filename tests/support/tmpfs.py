"""A small real filesystem that fills up: a tmpfs mounted for one test (needs root; where mounting
is not allowed tests skip with the reason, and fail under KVPOOL_CI=1)."""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.support.require import missing


@contextmanager
def small_tmpfs(path: Path, size: str = "256k") -> Iterator[Path]:
    """`path` (created) with a tmpfs of `size` mounted on it, unmounted afterwards."""
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        missing(f"cannot mount a tmpfs to fill up (needs root): "
                f"{done.stderr.strip() or done.returncode}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)


def fill(path: Path, leave_bytes: int = 0) -> Path:
    """A file that takes all the space of `path`'s filesystem but `leave_bytes` (rounded to
    pages); remove it to give the space back."""
    filler = path / "filler"
    chunk = b"\0" * 4096
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(chunk)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
        size = f.tell()
        f.truncate(max(0, size - leave_bytes))
    os.sync()
    return filler
