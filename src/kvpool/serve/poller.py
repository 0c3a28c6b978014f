"""Keeps the live cluster current: one task per worker reads `/info` until it joins, then
`/load` every `poll_interval_s`. Failed polls take a worker out of rotation (LiveCluster
decides when); a worker that answers again rejoins, after proving again that it holds the
token. A poll that times out (a busy or starved worker) keeps both the worker's place in
rotation and its proof, until `silent_dead_s` without an answer takes it out."""

from __future__ import annotations

import asyncio

from kvpool.errors import InvalidArgument, WorkerCallError
from kvpool.log import get_logger
from kvpool.serve.backend import EngineBackend
from kvpool.serve.cluster import LiveCluster

log = get_logger("serve.poller")


class Poller:
    def __init__(self, cluster: LiveCluster, client: EngineBackend, interval_s: float) -> None:
        self.cluster = cluster
        self.client = client
        self.interval_s = interval_s
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._refused: set[str] = set()
        self._not_joined: dict[str, str] = {}
        """url -> the last reason it has not joined (logged when it changes)."""
        self._crashed: dict[str, str] = {}
        """url -> the last unforeseen error of its polls (its traceback logged when it
        changes)."""

    def watch(self, url: str) -> None:
        """Start polling `url` (idempotent); needs a running event loop."""
        w = self.cluster.add(url)
        if w.url not in self._tasks:
            self._tasks[w.url] = asyncio.get_running_loop().create_task(self._loop(w.url))

    async def stop(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        self._tasks.clear()

    async def poll_once(self, url: str) -> None:
        w = self.cluster.workers[url]
        timeout_s = max(1.0, 4 * self.interval_s)
        try:
            if not w.alive or not self.client.proven(url):
                # joining, or after a connection failed: it proves it holds the token first
                await self._prove(url, timeout_s)
            if not w.alive:
                self.cluster.join(url, await self.client.info(url, timeout_s))
            path = f"/load?epoch={w.epoch}&since={w.events_to}" if w.epoch else "/load"
            load = await self.client.load(url, path, timeout_s)
            self.cluster.apply_load(url, load, self.cluster.clock_now())
        except WorkerCallError as exc:
            refused = exc.status is None and "Timeout" not in str(exc)
            if w.info is None:
                self._waiting(url, str(exc))
            if self.cluster.poll_failed(url, refused):
                log.warning("%s", exc)
        except InvalidArgument as exc:
            if url not in self._refused:
                self._refused.add(url)
                log.error("worker %s not admitted: %s", url, exc)

    async def _prove(self, url: str, timeout_s: float) -> None:
        """The worker at `url` proves itself; if whatever answers there does not (a refused
        or wrong proof, not a silence), it leaves the rotation at once (its runs go on
        elsewhere) rather than after the failed-poll count."""
        try:
            await self.client.prove(url, timeout_s)
        except WorkerCallError as exc:
            if exc.status is not None:
                self.cluster.withdraw(url, f"at once: it failed the token's challenge ({exc})")
            raise

    def _waiting(self, url: str, reason: str) -> None:
        """A configured worker that does not join is said so, with the reason, once per new
        reason (it is still tried every interval)."""
        if self._not_joined.get(url) != reason:
            self._not_joined[url] = reason
            log.warning("worker %s has not joined: %s (still trying)", url, reason)

    async def _loop(self, url: str) -> None:
        while True:
            try:
                await self.poll_once(url)
            except Exception as exc:  # what no parse foresaw: a failed poll, not a dead loop
                if self._crashed.get(url) != repr(exc):  # its traceback once per new error
                    self._crashed[url] = repr(exc)
                    log.exception("polling %s failed", url)
                self.cluster.poll_failed(url, False)
            await asyncio.sleep(self.interval_s)
