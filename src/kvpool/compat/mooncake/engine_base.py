"""Lifecycle and memory half of `mooncake.engine.TransferEngine` on kvpool's engine.

Method names, argument names, defaults and integer results follow Mooncake's Python binding
(0 = success, negative = failure; async batch ids are never 0, 0 means the submit failed).
Arguments Mooncake exposes only positionally (its `arg0` names) are positional-only here too,
so a keyword call raises TypeError in both. Failures are logged and turned into codes at this
edge; nothing raises for a dead peer or a bad address.
"""

from __future__ import annotations

import enum
import json
import threading
import weakref
from collections.abc import Sequence

from kvpool.compat.mooncake.config import split_hostname
from kvpool.compat.mooncake.lifecycle import attach_teardown
from kvpool.errors import KvpoolError
from kvpool.log import get_logger
from kvpool.transfer import OpCode, TransferConfig, TransferRequest
from kvpool.transfer import TransferEngine as NativeEngine
from kvpool.transfer.segment import parse_segment_name
from kvpool.transfer.tcp_client import open_connection

log = get_logger("compat.engine")

OK = 0
ERR_INVALID_ARGUMENT = -1
ERR_ADDRESS_NOT_REGISTERED = -3
ERR_ADDRESS_OVERLAPPED = -7
ERR_PROBE = -102
"""What a failed `send_probe` returns (Mooncake answers a dead peer with -102)."""

CHECK_DONE, CHECK_RUNNING, CHECK_FAILED, CHECK_TIMEOUT = 1, 0, -1, -2
_PROTOCOLS = {"tcp": "tcp", "shm": "shm", "auto": "auto"}


class TransferOpcode(enum.IntEnum):
    Read = 0
    Write = 1


Read = TransferOpcode.Read
Write = TransferOpcode.Write


class TransferNotify:
    """Accepted for signature compatibility; kvpool delivers no notifications."""

    def __init__(self, name: str = "", msg: str = "") -> None:
        self.name = name
        self.msg = msg


class EngineBase:
    """Lifecycle and memory of the compat TransferEngine (transfers live in engine.py)."""

    def __init__(self) -> None:
        self._engine: NativeEngine | None = None
        self._teardown: weakref.finalize | None = None
        self._lock = threading.Lock()
        self._order: list[int] = []  # registration order, for get_first_buffer_address

    # -- lifecycle -------------------------------------------------------------------------

    def initialize(self, local_hostname: str, metadata_server: str, protocol: str,
                   device_name: str, /) -> int:
        """Start listening on `local_hostname` ("host" or "host:port"); 0 or -1."""
        return self.initialize_ext(local_hostname, metadata_server, protocol, device_name, "")

    def initialize_ext(self, local_hostname: str, metadata_server: str, protocol: str,
                       device_name: str, metadata_type: str, /) -> int:
        if self._engine is not None:
            log.warning("initialize called twice; keeping the running engine")
            return ERR_INVALID_ARGUMENT
        host, port = split_hostname(local_hostname)
        transport = _PROTOCOLS.get(str(protocol).lower(), "auto")
        if transport != str(protocol).lower():
            log.info("protocol %r is not available in kvpool; using %s", protocol, transport)
        try:
            config = TransferConfig(host=host or "127.0.0.1", port=port,
                                    metadata=metadata_server, protocol=transport)
            engine = NativeEngine(config).start()
        except (KvpoolError, OSError, ValueError) as exc:
            log.error("initialize(%r, %r) failed: %s", local_hostname, metadata_server, exc)
            return ERR_INVALID_ARGUMENT
        self._engine = engine
        self._teardown = attach_teardown(self, engine.close, f"engine {engine.segment_name}")
        return OK

    def close(self) -> None:
        """kvpool extension: stop listening and unpublish. Mooncake does it when the engine
        is collected or at exit, and so does kvpool (lifecycle.py); idempotent, bounded."""
        teardown, self._teardown, self._engine = self._teardown, None, None
        if teardown is not None:
            teardown()

    def get_rpc_port(self) -> int:
        return int(self.native.segment_name.rsplit(":", 1)[1])

    def get_engine(self) -> NativeEngine:
        """The kvpool engine underneath (Mooncake returns its C++ engine handle)."""
        return self.native

    def get_engine_ptr(self) -> int:
        return id(self.native)

    def get_local_topology(self, device_name: str | None = None) -> str:
        return json.dumps({"cpu:0": {"preferred_hca": [], "avail_hca": []}})

    def get_notifies(self) -> list[TransferNotify]:
        return []

    @property
    def native(self) -> NativeEngine:
        if self._engine is None:
            raise RuntimeError("TransferEngine is not initialized: call initialize() first")
        return self._engine

    # -- memory ----------------------------------------------------------------------------

    def register_memory(self, buffer_addr: int, capacity: int, location: str = "*") -> int:
        """0, or -7 when the range overlaps registered memory, -1 for a bad range."""
        with self._lock:
            if buffer_addr <= 0 or capacity <= 0:
                return ERR_INVALID_ARGUMENT
            if self._overlaps(buffer_addr, capacity):
                return ERR_ADDRESS_OVERLAPPED
            try:
                self.native.register_address(buffer_addr, capacity)
            except KvpoolError as exc:
                log.warning("register_memory(%#x, %d): %s", buffer_addr, capacity, exc)
                return ERR_INVALID_ARGUMENT
            self._order.append(buffer_addr)
        return OK

    def _overlaps(self, addr: int, length: int) -> bool:
        return any(b.addr < addr + length and addr < b.addr + b.length
                   for b in self.native.registry.buffers())

    def unregister_memory(self, buffer_addr: int, /) -> int:
        with self._lock:
            try:
                self.native.unregister(buffer_addr)
            except KvpoolError:
                return ERR_ADDRESS_NOT_REGISTERED
            if buffer_addr in self._order:
                self._order.remove(buffer_addr)
        return OK

    def batch_register_memory(self, buffer_addresses: Sequence[int], capacities: Sequence[int],
                              location: str = "*") -> int:
        """All or nothing, as Mooncake's: on a failure the regions this call registered
        before it are unregistered again (the caller takes the memory back, so no peer may
        still write into it)."""
        if len(buffer_addresses) != len(capacities):
            return ERR_INVALID_ARGUMENT
        done: list[int] = []
        for addr, length in zip(buffer_addresses, capacities, strict=True):
            code = self.register_memory(addr, length, location)
            if code != OK:
                for registered in reversed(done):
                    self.unregister_memory(registered)
                return code
            done.append(addr)
        return OK

    def batch_unregister_memory(self, buffer_addresses: Sequence[int], /) -> int:
        codes = [self.unregister_memory(addr) for addr in buffer_addresses]
        return next((c for c in codes if c != OK), OK)

    def allocate_managed_buffer(self, length: int, /) -> int:
        """Address of a new registered buffer, 0 on failure."""
        try:
            buf = self.native.allocate_managed(length)
        except (KvpoolError, OSError) as exc:
            log.warning("allocate_managed_buffer(%d): %s", length, exc)
            return 0
        with self._lock:
            self._order.append(buf.addr)
        return buf.addr

    def free_managed_buffer(self, buffer_addr: int, length: int, /) -> int:
        try:
            self.native.free_managed(buffer_addr)
        except (KvpoolError, KeyError):
            return ERR_ADDRESS_NOT_REGISTERED
        with self._lock:
            if buffer_addr in self._order:
                self._order.remove(buffer_addr)
        return OK

    def get_first_buffer_address(self, segment_name: str, /) -> int:
        """First registered buffer of a segment. For a peer, kvpool only knows its managed
        (shared-memory) buffers; 0 when none is known."""
        if segment_name == self.native.segment_name:
            with self._lock:
                return self._order[0] if self._order else 0
        try:
            descriptor = self.native._started_router()._peers.lookup(segment_name)
        except KvpoolError:
            return 0
        return min((r.addr for r in descriptor.shm_regions), default=0)

    def write_bytes_to_buffer(self, dest_address: int, src: bytes | str, length: int, /) -> int:
        data = src.encode() if isinstance(src, str) else bytes(src)
        view = self.native.registry.view(dest_address, length)
        if view is None or length > len(data):
            return ERR_INVALID_ARGUMENT
        view[:] = data[:length]
        return OK

    def read_bytes_from_buffer(self, source_address: int, length: int, /) -> bytes:
        view = self.native.registry.view(source_address, length)
        return b"" if view is None else bytes(view)

    # -- helpers for the transfer half -------------------------------------------------------

    def _requests(self, op: OpCode, target: str, buffers: Sequence[int],
                  peers: Sequence[int], lengths: Sequence[int]) -> list[TransferRequest] | None:
        if not len(buffers) == len(peers) == len(lengths):
            return None
        return [TransferRequest(op, int(b), int(n), target, int(p))
                for b, p, n in zip(buffers, peers, lengths, strict=True)]

    def send_probe(self, peer_server_name: str) -> int:
        """0 when the peer's engine answers a handshake, nonzero otherwise."""
        try:
            host, port = parse_segment_name(peer_server_name)
            sock, _ = open_connection(host, port, self.native.config, self.native.segment_name)
        except (KvpoolError, OSError) as exc:
            log.debug("probe of %s failed: %s", peer_server_name, exc)
            return ERR_PROBE
        sock.close()
        return OK

