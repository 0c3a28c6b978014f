"""asyncio face of the store client.

Each call runs the blocking StoreClient call on a small thread pool, so the event loop never
blocks on the master or on a transfer; results are the same typed values. Calls from many
coroutines overlap their transfers; master RPCs are serialized on one connection.

A call whose task is cancelled (asyncio.wait_for, an aborted request) raises CancelledError
only once the blocking call has returned: until then it may still read or write the caller's
memory, which is the caller's again only after that. A cancelled put may still be stored.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from kvpool.store.client.config import ClientConfig
from kvpool.store.client.plan import Part
from kvpool.store.client.store_client import DEFAULT, SizeResult, StoreClient
from kvpool.store.config import ReplicateConfig
from kvpool.store.wire.codes import ErrorCode, GetResult, LookupResult, PutResult, ReadResult

T = TypeVar("T")


class AsyncStoreClient:
    def __init__(self, client: StoreClient, max_workers: int = 4) -> None:
        self.client = client
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="kvpool-store-aio")

    @classmethod
    async def connect(cls, config: ClientConfig, max_workers: int = 4) -> AsyncStoreClient:
        """Start a StoreClient (transfer engine, master connection, mounts) off the loop."""
        loop = asyncio.get_running_loop()
        started = loop.run_in_executor(None, StoreClient, config)
        try:
            client = await asyncio.shield(started)
        except asyncio.CancelledError:  # a client built after all is closed, not leaked
            started.add_done_callback(_close_built)
            raise
        return cls(client, max_workers)

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await _to_the_end(asyncio.get_running_loop().run_in_executor(
            self._pool, functools.partial(fn, *args)))

    async def put(self, key: str, value: Any, config: ReplicateConfig = DEFAULT) -> PutResult:
        return await self._run(self.client.put, key, value, config)

    async def upsert(self, key: str, value: Any, config: ReplicateConfig = DEFAULT) -> PutResult:
        return await self._run(self.client.upsert, key, value, config)

    async def put_batch(self, keys: Sequence[str], values: Sequence[Any],
                        config: ReplicateConfig = DEFAULT) -> list[PutResult]:
        return await self._run(self.client.put_batch, keys, values, config)

    async def get(self, key: str) -> GetResult:
        return await self._run(self.client.get, key)

    async def get_batch(self, keys: Sequence[str]) -> list[GetResult]:
        return await self._run(self.client.get_batch, keys)

    async def put_from(self, key: str, addr: int, size: int,
                       config: ReplicateConfig = DEFAULT) -> PutResult:
        return await self._run(self.client.put_from, key, addr, size, config)

    async def batch_put_from(self, keys: Sequence[str], addrs: Sequence[int],
                             sizes: Sequence[int],
                             config: ReplicateConfig = DEFAULT) -> list[PutResult]:
        return await self._run(self.client.batch_put_from, keys, addrs, sizes, config)

    async def batch_put_from_parts(self, keys: Sequence[str], parts: Sequence[Sequence[Part]],
                                   config: ReplicateConfig = DEFAULT) -> list[PutResult]:
        return await self._run(self.client.batch_put_from_parts, keys, parts, config)

    async def get_into(self, key: str, addr: int, size: int) -> ReadResult:
        return await self._run(self.client.get_into, key, addr, size)

    async def batch_get_into(self, keys: Sequence[str], addrs: Sequence[int],
                             sizes: Sequence[int]) -> list[ReadResult]:
        return await self._run(self.client.batch_get_into, keys, addrs, sizes)

    async def batch_get_into_parts(self, keys: Sequence[str],
                                   parts: Sequence[Sequence[Part]]) -> list[ReadResult]:
        return await self._run(self.client.batch_get_into_parts, keys, parts)

    async def exists(self, key: str) -> ErrorCode:
        return await self._run(self.client.exists, key)

    async def batch_exists(self, keys: Sequence[str]) -> list[ErrorCode]:
        return await self._run(self.client.batch_exists, keys)

    async def size(self, key: str) -> SizeResult:
        return await self._run(self.client.size, key)

    async def batch_size(self, keys: Sequence[str]) -> list[SizeResult]:
        return await self._run(self.client.batch_size, keys)

    async def replica_desc(self, key: str) -> LookupResult:
        return await self._run(self.client.replica_desc, key)

    async def remove(self, key: str, force: bool = False) -> ErrorCode:
        return await self._run(self.client.remove, key, force)

    async def batch_remove(self, keys: Sequence[str], force: bool = False) -> list[ErrorCode]:
        return await self._run(self.client.batch_remove, keys, force)

    async def remove_all(self, force: bool = False) -> int:
        return await self._run(self.client.remove_all, force)

    async def close(self) -> None:
        await self._run(self.client.close)
        self._pool.shutdown(wait=True)

    async def __aenter__(self) -> AsyncStoreClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def _to_the_end(call: asyncio.Future[T]) -> T:
    """`call`'s result; when the awaiting task is cancelled, CancelledError only once `call`
    has returned (its thread may be copying into the caller's memory until then)."""
    try:
        return await asyncio.shield(call)
    except asyncio.CancelledError:
        while not call.done():
            try:
                await asyncio.shield(call)
            except asyncio.CancelledError:
                pass
            except Exception:  # noqa: BLE001 - the call's own failure: the cancel wins
                break
        raise


def _close_built(started: asyncio.Future[StoreClient]) -> None:
    """Close the client a cancelled `connect` built after all (in a thread: closing waits on
    the master)."""
    if not started.cancelled() and started.exception() is None:
        threading.Thread(target=started.result().close, name="kvpool-store-aio-close",
                         daemon=True).start()

