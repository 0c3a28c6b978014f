"""LegWatch (serve/legwatch.py): one watcher per streamed leg. A worker leaving the rotation
during a read ends it with WorkerCallError; between reads, the next read fails at once; a
cancellation from elsewhere stays a CancelledError; no task is made per read."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from kvpool.errors import WorkerCallError
from kvpool.serve.cluster import WorkerState
from kvpool.serve.legwatch import LegWatch, watched


async def lines(gate: asyncio.Event, n: int) -> AsyncIterator[int]:
    for i in range(n):
        if i == 2:
            await gate.wait()  # the third line never comes unless the gate opens
        yield i


def test_reads_pass_through_and_no_task_is_made_per_read() -> None:
    async def main() -> list[int]:
        worker = WorkerState("http://w")
        gate = asyncio.Event()
        gate.set()
        watch, it, got = LegWatch(worker, "/generate"), lines(gate, 50), []
        tasks = len(asyncio.all_tasks())
        for _ in range(50):
            got.append(await watch.read(anext(it)))
            assert len(asyncio.all_tasks()) == tasks
        watch.close()
        return got
    assert asyncio.run(main()) == list(range(50))


def test_down_during_a_read_ends_it_with_worker_call_error() -> None:
    async def main() -> None:
        worker, gate = WorkerState("http://w"), asyncio.Event()
        watch, it = LegWatch(worker, "/generate"), lines(gate, 5)
        assert [await watch.read(anext(it)) for _ in range(2)] == [0, 1]
        asyncio.get_running_loop().call_later(0.05, worker.down.set)
        with pytest.raises(WorkerCallError, match="stopped answering its health checks"):
            await watch.read(anext(it))
        assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]
        await asyncio.sleep(0)  # nothing pending: the task is not cancelled later
        watch.close()
    asyncio.run(main())


def test_down_between_reads_fails_the_next_one_at_once() -> None:
    async def main() -> None:
        worker, gate = WorkerState("http://w"), asyncio.Event()
        gate.set()
        watch, it = LegWatch(worker, "/generate"), lines(gate, 5)
        await watch.read(anext(it))
        worker.down.set()
        await asyncio.sleep(0)
        with pytest.raises(WorkerCallError, match="out of rotation"):
            await watch.read(anext(it))
        watch.close()
    asyncio.run(main())


def test_a_cancel_from_elsewhere_stays_a_cancel() -> None:
    async def main() -> None:
        worker, gate = WorkerState("http://w"), asyncio.Event()
        watch, it = LegWatch(worker, "/generate"), lines(gate, 5)

        async def consume() -> None:
            while True:
                await watch.read(anext(it))

        task = asyncio.ensure_future(consume())
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        watch.close()
    asyncio.run(main())


def test_a_single_watched_call_ends_with_the_worker() -> None:
    async def main() -> None:
        worker = WorkerState("http://w")
        assert await watched(asyncio.sleep(0, "reply"), worker, "/prefill") == "reply"
        asyncio.get_running_loop().call_later(0.05, worker.down.set)
        with pytest.raises(WorkerCallError, match="/prefill: worker stopped answering"):
            await watched(asyncio.sleep(3600), worker, "/prefill")
        with pytest.raises(WorkerCallError, match="out of rotation"):
            await watched(asyncio.sleep(0), worker, "/prefill")
    asyncio.run(main())
