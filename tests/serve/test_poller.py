"""The poller over a real socket and the real WorkerClient (with a token), on a virtual clock
for the cluster's deadlines: a worker whose /load times out stays in rotation *and* proven
(no request of it fails as "not proven"), leaves the rotation only after silent_dead_s
without an answer, and proves itself again to rejoin; a refused connection withdraws the
proof."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from kvpool.clock import VirtualClock
from kvpool.conductor import CostModel
from kvpool.engine.worker import auth
from kvpool.engine.worker.auth import CHALLENGE_PATH
from kvpool.serve.cluster import LiveCluster
from kvpool.serve.poller import Poller
from kvpool.serve.worker_client import WorkerClient
from tests.serve.test_cluster import info, load

TOKEN = "cluster-token"


class SlowWorker:
    """An HTTP/1.1 listener that answers the challenge, /info and /load as a worker does;
    with `stalled` set, /load never answers."""

    def __init__(self) -> None:
        self.stalled = False
        self.challenges = 0
        self.incarnation = "abc1"
        self.token = TOKEN
        self.loads: list[str] = []
        self.port = 0
        self.connections: set[asyncio.Task[None]] = set()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.connections.add(task)
        try:
            while head := await reader.readuntil(b"\r\n\r\n"):
                method, target = head.split(b" ", 2)[:2]
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                body = await reader.readexactly(length)
                reply = await self.answer(method.decode(), target.decode(), body)
                data = json.dumps(reply).encode()
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()
            self.connections.discard(task)

    async def answer(self, method: str, target: str, body: bytes) -> object:
        if target == CHALLENGE_PATH:
            self.challenges += 1
            return auth.answer(self.token, "127.0.0.1", self.port, json.loads(body),
                               incarnation=self.incarnation)
        if target == "/info":
            return info("decode").model_dump()
        if self.stalled:
            await asyncio.sleep(3600)
        self.loads.append(target)
        return load([]).model_dump(exclude_none=True)


@asynccontextmanager
async def slow_worker() -> AsyncIterator[tuple[SlowWorker, str]]:
    worker = SlowWorker()
    server = await asyncio.start_server(worker.handle, "127.0.0.1", 0)
    worker.port = server.sockets[0].getsockname()[1]
    try:
        yield worker, f"http://127.0.0.1:{worker.port}"
    finally:
        server.close()
        for task in list(worker.connections):  # and every open connection with it
            task.cancel()
        await asyncio.gather(*worker.connections, return_exceptions=True)


def test_a_timed_out_poll_keeps_the_worker_in_rotation_and_proven() -> None:
    async def main() -> None:
        clock = VirtualClock()
        cluster = LiveCluster(CostModel(), clock, silent_dead_s=10.0)
        client = WorkerClient(5.0, token=TOKEN)
        poller = Poller(cluster, client, interval_s=0.05)  # a poll times out after 1 s
        async with slow_worker() as (worker, url):
            cluster.add(url)
            await poller.poll_once(url)
            w = cluster.workers[url]
            assert w.alive and client.proven(url) and worker.challenges == 1
            worker.stalled = True
            clock.advance(4.0)
            await poller.poll_once(url)  # times out, 6 s before silent_dead_s
            assert w.alive and client.proven(url) and not w.down.is_set()
            clock.advance(6.0)
            await poller.poll_once(url)  # 10 s without an answer: out
            assert not w.alive and w.down.is_set()
            worker.stalled = False
            await poller.poll_once(url)  # back: proves itself again, then rejoins
            assert w.alive and client.proven(url) and worker.challenges == 2
        await poller.poll_once(url)  # the listener is gone: refused, the proof withdrawn
        assert not client.proven(url) and w.alive and w.failures == 1
        await client.aclose()
    asyncio.run(main())


def test_a_worker_that_fails_its_proof_leaves_the_rotation_at_once() -> None:
    """Another listener on the port (another token, here) answers the challenge with a proof
    that does not check: out of the rotation after that one poll, its runs handed over
    (`down`), and sent nothing but the challenge; the real worker back proves and rejoins."""
    async def main() -> None:
        cluster = LiveCluster(CostModel(), VirtualClock(), silent_dead_s=10.0)
        client = WorkerClient(5.0, token=TOKEN)
        poller = Poller(cluster, client, interval_s=0.05)
        async with slow_worker() as (worker, url):
            cluster.add(url)
            await poller.poll_once(url)
            w = cluster.workers[url]
            assert w.alive and len(worker.loads) == 1
            worker.token, worker.incarnation = "another-token", "abc2"
            client._proven.pop(url)  # as after a refused connection
            await poller.poll_once(url)
            assert not w.alive and w.down.is_set() and len(worker.loads) == 1
            worker.token = TOKEN
            await poller.poll_once(url)
            assert w.alive and client.proven(url) and len(worker.loads) == 2
        await client.aclose()
    asyncio.run(main())


class BrokenLoads(WorkerClient):
    """A backend whose /load answers raise what no parse foresaw (vLLM's /metrics once made
    the vllm backend raise ValueError on a NaN sample)."""

    broken = False

    async def load(self, url: str, path: str, timeout_s: float):  # type: ignore[no-untyped-def]
        if self.broken:
            raise ValueError("cannot convert float NaN to integer")
        return await super().load(url, path, timeout_s)


def test_an_unforeseen_error_is_a_failed_poll_and_the_polling_goes_on() -> None:
    async def main() -> None:
        clock = VirtualClock()
        cluster = LiveCluster(CostModel(), clock, silent_dead_s=10.0)
        client = BrokenLoads(5.0, token=TOKEN)
        poller = Poller(cluster, client, interval_s=0.01)
        async with slow_worker() as (worker, url):
            poller.watch(url)
            w = cluster.workers[url]
            while not w.alive:
                await asyncio.sleep(0.01)
            client.broken = True
            clock.advance(10.0)
            while w.alive:  # the next poll fails, 10 s after the last good one: out
                await asyncio.sleep(0.01)
                assert not poller._tasks[url].done()
            client.broken = False
            while not w.alive:  # and back once its answers are
                await asyncio.sleep(0.01)
            await poller.stop()
        await client.aclose()
    asyncio.run(asyncio.wait_for(main(), 10.0))
