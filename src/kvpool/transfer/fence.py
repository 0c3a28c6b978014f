"""Write fences: a u64 tag on a registered region that every request into it must match.

A region carries a fence (0 = unfenced). A request carries the fence it was planned against
(0 = none). A fenced region accepts a request only when the fences are equal, so a writer that
planned against an earlier registration of the region (e.g. a replica that was freed and
handed out again) cannot land its bytes there.

In this process every write is admitted through `Fence.enter` before its bytes are copied and
released with `Fence.leave` after, so `Fence.set` can wait until no write admitted under the
old fence is still copying: after `set` returns, only writes that match the new fence land.
Same-host peers that memcpy through shared memory use the header word and file lock of
`kvpool.transfer.memory.SharedMemoryArena` instead.
"""

from __future__ import annotations

import threading

from kvpool.errors import InvalidArgument, TransferTimeout
from kvpool.transfer.protocol import MAX_FENCE

READ_ADMITTED = -1
"""Token of an admitted read: nothing to release."""


def check_fence(fence: int) -> int:
    """`fence` as an int, or InvalidArgument when it is not a u64."""
    if isinstance(fence, bool) or not isinstance(fence, int) or not 0 <= fence <= MAX_FENCE:
        raise InvalidArgument(f"fence must be an integer in 0..2**64-1, got {fence!r}")
    return fence


def admits(region_fence: int, request_fence: int) -> bool:
    return region_fence == 0 or region_fence == request_fence


class Fence:
    """The fence of one region and the writes in flight under each of its values."""

    def __init__(self, value: int = 0) -> None:
        self._value = check_fence(value)
        self._cond = threading.Condition()
        self._epoch = 0
        self._inflight: dict[int, int] = {}  # epoch -> writes admitted under it, still copying
        self._retired = False
        """The region was unregistered: nothing more is admitted (`retire`)."""

    @property
    def value(self) -> int:
        return self._value

    def enter(self, fence: int, write: bool, count: int = 1) -> int | None:
        """Admit a request planned against `fence` (`count` writes planned against it at
        once, e.g. the descriptors of one frame into this region: all or none): a token for
        `leave`, or None if refused."""
        if not write:
            return READ_ADMITTED if admits(self._value, fence) and not self._retired else None
        with self._cond:
            if self._retired or not admits(self._value, fence):
                return None
            self._inflight[self._epoch] = self._inflight.get(self._epoch, 0) + count
            return self._epoch

    def leave(self, token: int, count: int = 1) -> None:
        """The copy admitted with `token` ended (finished or failed); `count` as entered."""
        if token == READ_ADMITTED:
            return
        with self._cond:
            left = self._inflight[token] - count
            if left:
                self._inflight[token] = left
            else:
                del self._inflight[token]
                self._cond.notify_all()

    def retire(self, timeout_s: float) -> None:
        """Admit nothing more (the region is being unregistered: a request that found it
        just before is refused), then wait as `set` does for the writes admitted before."""
        with self._cond:
            self._retired = True
        self.set(self._value, timeout_s)

    def set(self, value: int, timeout_s: float) -> None:
        """Change the fence, then wait until every write admitted before is done copying.

        Raises TransferTimeout if one is still copying after `timeout_s`; the new fence is in
        force either way (no write is admitted under the old one any more).
        """
        check_fence(value)
        with self._cond:
            self._value = value
            self._epoch += 1
            epoch = self._epoch
            if not self._cond.wait_for(lambda: min(self._inflight, default=epoch) >= epoch, timeout_s):
                raise TransferTimeout(f"fence set to {value}, but a write admitted under the old "
                                      f"fence is still copying after {timeout_s:g}s")
