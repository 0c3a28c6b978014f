"""Ending the tasks a request started, for sure, before it goes on.

A client that goes away cancels its request through starlette's anyio cancel scope, which
cancels every later await of that request too. Cleanup that waits for a task (one reading a
worker's stream) must therefore be shielded, or the task is left running the very generator
the request then closes ("aclose(): asynchronous generator is already running")."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

import anyio


async def cancel_and_wait(*tasks: asyncio.Future[Any]) -> None:
    """Cancel `tasks` and wait until every one has ended, even while the caller is being
    cancelled itself; their results and exceptions are consumed."""
    for task in tasks:
        task.cancel()
    with anyio.CancelScope(shield=True):
        await asyncio.gather(*tasks, return_exceptions=True)


async def close_all(*gens: AsyncGenerator[Any]) -> None:
    """Close async generators (each releasing what it holds in its `finally`), even while the
    caller is being cancelled; their exceptions are consumed."""
    with anyio.CancelScope(shield=True):
        await asyncio.gather(*(g.aclose() for g in gens), return_exceptions=True)
