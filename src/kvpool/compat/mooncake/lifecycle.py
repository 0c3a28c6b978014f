"""Tearing down what a compat store or engine started, the way Mooncake's destructors do.

Mooncake's Python objects unmount their segment and unpublish their engine when they are
garbage-collected or when the interpreter exits; engines rely on it (SGLang's HiCache detaches
a storage backend by dropping it). kvpool's objects run threads (heartbeat, accept loop), so
the teardown must not live on the object those threads keep alive, nor wait on them:

    compat object --weakref.finalize--> close_bounded(native.close)
         |                                  |
         +--> native client/engine <--------+   (threads reference only the native side)

`weakref.finalize` fires when the compat object is collected and, for those still alive, at
interpreter exit. The teardown runs in a helper thread that the caller waits for at most
CLOSE_BOUND_S, and never from one of kvpool's own threads (a collection that happens to run
there must not join the thread it runs on, nor wait on a lock that thread holds).
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable

from kvpool.log import get_logger

log = get_logger("compat.lifecycle")

CLOSE_BOUND_S = 10.0
"""Longest a `close()` (or a finalizer) waits for the teardown; the rest finishes in the
background. Covers the heartbeat join (1 s + the 5 s RPC timeout) and the unmount RPC."""
_KVPOOL_THREAD_PREFIX = "kvpool-"


def _quietly(close: Callable[[], object], what: str) -> None:
    try:
        close()
    except Exception as exc:  # a teardown must never raise into a finalizer or close()
        log.warning("closing %s failed: %s", what, exc)


def close_bounded(close: Callable[[], object], what: str,
                  bound_s: float = CLOSE_BOUND_S) -> bool:
    """Run `close()` and wait for it at most `bound_s`; True when it finished in time.
    From one of kvpool's threads it is started and not waited for."""
    try:
        helper = threading.Thread(target=_quietly, args=(close, what), daemon=True,
                                  name=f"{_KVPOOL_THREAD_PREFIX}close")
        helper.start()
    except RuntimeError:  # no new threads late in interpreter shutdown: close inline
        _quietly(close, what)
        return True
    if threading.current_thread().name.startswith(_KVPOOL_THREAD_PREFIX):
        return False
    helper.join(bound_s)
    if helper.is_alive():
        log.warning("closing %s took over %.0fs; finishing in the background", what, bound_s)
        return False
    return True


def _in_owner_process(pid: int, close: Callable[[], object], what: str) -> None:
    """Tear down only in the process that set up: a forked child that exits normally
    inherits the finalizer, and must not unmount its parent's segment."""
    if os.getpid() == pid:
        close_bounded(close, what)


def attach_teardown(owner: object, close: Callable[[], object], what: str) -> weakref.finalize:
    """Call `close` (bounded) when `owner` is collected or at interpreter exit, or when the
    returned finalizer is called, whichever comes first; only once, and only in this
    process. `close` must not refer to `owner`."""
    finalizer = weakref.finalize(owner, _in_owner_process, os.getpid(), close, what)
    finalizer.atexit = True
    return finalizer
