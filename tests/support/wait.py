"""The tests' one polling wait: a condition on something real (a process, a socket, a file)
checked until it holds or a deadline passes. Waits on a virtual clock do not poll; they advance it."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(check: Callable[[], T], timeout_s: float = 10.0,
             what: str | Callable[[], object] = "", step_s: float = 0.02) -> T:
    """Call `check` every `step_s` until it returns something true, and return that; after
    `timeout_s` raise TimeoutError naming `what` (a string, or a callable for a description of
    the state at that moment)."""
    deadline = time.monotonic() + timeout_s
    while not (found := check()):
        if time.monotonic() > deadline:
            said = what() if callable(what) else what
            raise TimeoutError(f"not within {timeout_s} s: {said or 'the condition'}")
        time.sleep(step_s)
    return found
