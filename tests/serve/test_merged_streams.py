"""The choices of one streamed request (`n` > 1, or several prompts) merged into one stream:
a client that reads nothing holds them all back, as it holds back a single one."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from kvpool.serve.responses import _merged


def test_a_client_that_stops_reading_holds_back_every_choice() -> None:
    produced = [0, 0]

    async def choice(i: int) -> AsyncIterator[bytes]:
        for k in range(100):
            produced[i] += 1
            yield f"{i}:{k}".encode()

    async def main() -> list[bytes]:
        merged = _merged([choice(0), choice(1)])
        got = [await merged.__anext__() for _ in range(3)]
        await asyncio.sleep(0.05)               # the client reads nothing meanwhile
        assert sum(produced) <= 3 + 2 * 2 + 2, produced   # a few items wait, not 200
        got += [item async for item in merged]
        return got

    got = asyncio.run(main())
    assert sorted(got) == sorted(f"{i}:{k}".encode() for i in range(2) for k in range(100))
    for i in range(2):  # each choice's items in their order
        mine = [g for g in got if g.startswith(f"{i}:".encode())]
        assert mine == [f"{i}:{k}".encode() for k in range(100)]
