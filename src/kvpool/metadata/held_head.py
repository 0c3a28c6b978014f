"""A connection's transport that writes a response's head with the first bytes of its body.

uvicorn writes a response's head (`http.response.start`) at once, and its body's first bytes
with the next send: two send system calls per response, each paying, on loopback, for the
receiver's TCP processing and wake-up too. A server answers most requests with a head and its
first body bytes in the same run of its event loop (a JSON body right after its start, a
stream's first chunk ready when it starts), so `HeldHead` holds a head until the next write
and sends both in one; a head that nothing follows in that run goes out alone at the loop's
next turn (`call_soon`). Bytes go out in the order they were written, whatever is held.

    transport = HeldHead(transport, loop)   # for the protocol: the same transport API
"""

from __future__ import annotations

import asyncio
from typing import Any

HEAD = b"HTTP/1.1 "
"""How a response head starts (uvicorn answers HTTP/1.1)."""


class HeldHead:
    __slots__ = ("_transport", "_loop", "_held")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport, self._loop = transport, loop
        self._held: bytes | None = None

    def write(self, data: bytes | bytearray | memoryview) -> None:
        held = self._held
        if held is not None:
            self._held = None
            self._transport.write(held + data)
        elif data[:9] == HEAD:
            self._held = bytes(data)
            self._loop.call_soon(self.flush)
        else:
            self._transport.write(data)

    def flush(self) -> None:
        """Write what is held, if anything."""
        held, self._held = self._held, None
        if held is not None and not self._transport.is_closing():
            self._transport.write(held)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def abort(self) -> None:
        self._held = None
        self._transport.abort()

    def __getattr__(self, name: str) -> Any:  # the rest of the transport's API, as is
        return getattr(self._transport, name)
