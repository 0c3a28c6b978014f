"""IdleTimeout: one timer for a repeated await. A run of short awaits that together last far
longer than the limit is never cut; an await that waits past it is a TimeoutError; a cancel
from elsewhere stays a cancel; the timer lapses between awaits and is dropped by close()."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvpool.idle_timeout import IdleTimeout


def test_short_awaits_past_the_limit_in_all_are_never_cut() -> None:
    async def go() -> list[int]:
        q: asyncio.Queue[int] = asyncio.Queue()
        deadline = IdleTimeout()

        async def feed() -> None:
            for i in range(20):
                await asyncio.sleep(0.05)
                q.put_nowait(i)
        feeder = asyncio.ensure_future(feed())
        got = [await deadline.wait(q.get(), 0.3) for _ in range(20)]  # 1 s, each under 0.3
        deadline.close()
        await feeder
        return got
    assert asyncio.run(go()) == list(range(20))


def test_an_await_past_the_limit_is_a_timeout_and_the_queue_is_left_intact() -> None:
    async def go() -> None:
        q: asyncio.Queue[int] = asyncio.Queue()
        deadline = IdleTimeout()
        q.put_nowait(1)
        assert await deadline.wait(q.get(), 0.3) == 1
        await asyncio.sleep(0.5)  # the timer lapses between awaits: no timeout for this gap
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            await deadline.wait(q.get(), 0.3)
        assert 0.3 <= time.monotonic() - t0 < 1.0
        q.put_nowait(2)  # the cancelled get took nothing
        assert await deadline.wait(q.get(), 0.3) == 2
        deadline.close()
    asyncio.run(go())


def test_a_cancel_from_elsewhere_stays_a_cancel_and_close_drops_the_timer() -> None:
    async def go() -> None:
        deadline = IdleTimeout()
        task = asyncio.ensure_future(deadline.wait(asyncio.sleep(5), 0.3))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert deadline.armed
        deadline.close()
        assert not deadline.armed
    asyncio.run(go())


def test_a_shorter_limit_after_a_longer_one_is_kept() -> None:
    """One connection's reads: a stream's (a long limit) leaves its timer set; a poll on the
    same connection next (a short limit) still times out at its own limit."""
    async def go() -> float:
        loop = asyncio.get_running_loop()
        deadline = IdleTimeout()
        done = loop.create_future()
        done.set_result(1)
        assert await deadline.wait(done, 600.0) == 1
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            await deadline.wait(loop.create_future(), 0.2)
        deadline.close()
        return time.monotonic() - t0
    assert 0.2 <= asyncio.run(go()) < 1.0


def test_a_task_already_being_cancelled_still_gets_its_timeout() -> None:
    """As with asyncio.timeout: the timer's own cancel is told apart by the count on entry."""
    async def go() -> str:
        task = asyncio.current_task()
        assert task is not None
        task.cancel()
        try:
            await asyncio.sleep(1)
        except asyncio.CancelledError:
            pass  # caught, not uncancelled: one request still counted
        deadline = IdleTimeout()
        try:
            await deadline.wait(asyncio.get_running_loop().create_future(), 0.1)
        except TimeoutError:
            return "timeout"
        except asyncio.CancelledError:
            return "cancelled"
        finally:
            deadline.close()
        return "none"
    assert asyncio.run(go()) == "timeout"
