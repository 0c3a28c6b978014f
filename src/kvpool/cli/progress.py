"""A progress bar on stderr for the slow steps a person waits on (a GGUF import: tens of
seconds), fed by an engine-side callback (gguf_checkpoint.ImportProgress)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def progress_bar(desc: str, unit: str = "step",
                 enabled: bool = True) -> Iterator[Callable[[int, int], None] | None]:
    """A `(done, total)` callback drawing a bar on stderr, made at its first call (a step that
    fails its checks draws nothing) and closed on exit; None when not `enabled`."""
    if not enabled:
        yield None
        return
    bar: Any = None

    def update(done: int, total: int) -> None:
        nonlocal bar
        if bar is None:
            from tqdm import tqdm

            bar = tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, mininterval=0.5)
        bar.update(done - bar.n)

    try:
        yield update
    finally:
        if bar is not None:
            bar.close()
