"""`mooncake.engine.TransferEngine` on kvpool's transfer engine.

Method names, argument names, defaults and integer results follow Mooncake's Python binding:
0 = success, negative = failure; async calls return a batch id that is never 0 (0 means the
submit failed); `transfer_check_status` answers 1 done, 0 running, -1 failed, -2 timed out,
and forgets a batch once it reported it finished. Arguments Mooncake exposes only
positionally are positional-only here too, so a keyword call raises TypeError in both.

    te = TransferEngine()
    te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    te.batch_register_memory([kv.data_ptr()], [kv.nbytes])
    te.batch_transfer_sync_write(f"{peer_host}:{peer_rpc_port}", srcs, dsts, lengths)
"""

from __future__ import annotations

from collections.abc import Sequence

from kvpool.clock import SYSTEM_CLOCK, Clock
from kvpool.compat.mooncake.engine_base import (
    CHECK_DONE,
    CHECK_FAILED,
    CHECK_RUNNING,
    CHECK_TIMEOUT,
    ERR_INVALID_ARGUMENT,
    OK,
    EngineBase,
    Read,
    TransferNotify,
    TransferOpcode,
    Write,
    log,
)
from kvpool.errors import KvpoolError
from kvpool.transfer import OpCode, RequestState

__all__ = ["Read", "TransferEngine", "TransferNotify", "TransferOpcode", "Write"]

_OPS = {TransferOpcode.Read: OpCode.READ, TransferOpcode.Write: OpCode.WRITE}


class TransferEngine(EngineBase):
    def __init__(self) -> None:
        super().__init__()
        self._deadlines: dict[int, float] = {}
        self.clock: Clock = SYSTEM_CLOCK
        """The time of the async batches' deadlines (Mooncake's constructor takes none)."""

    # -- synchronous -----------------------------------------------------------------------

    def transfer_sync_write(self, target_hostname: str, buffer: int, peer_buffer_address: int,
                            length: int, transport_hint: str = "") -> int:
        return self._sync(OpCode.WRITE, target_hostname, [buffer], [peer_buffer_address],
                          [length])

    def transfer_sync_read(self, target_hostname: str, buffer: int, peer_buffer_address: int,
                           length: int, transport_hint: str = "") -> int:
        return self._sync(OpCode.READ, target_hostname, [buffer], [peer_buffer_address], [length])

    def transfer_sync(self, target_hostname: str, buffer: int, peer_buffer_address: int,
                      length: int, opcode: TransferOpcode, notify: TransferNotify | None = None,
                      transport_hint: str = "") -> int:
        return self._sync(_OPS[TransferOpcode(opcode)], target_hostname, [buffer],
                          [peer_buffer_address], [length])

    def batch_transfer_sync_write(self, target_hostname: str, buffers: Sequence[int],
                                  peer_buffer_addresses: Sequence[int], lengths: Sequence[int],
                                  transport_hint: str = "") -> int:
        return self._sync(OpCode.WRITE, target_hostname, buffers, peer_buffer_addresses, lengths)

    def batch_transfer_sync_read(self, target_hostname: str, buffers: Sequence[int],
                                 peer_buffer_addresses: Sequence[int], lengths: Sequence[int],
                                 transport_hint: str = "") -> int:
        return self._sync(OpCode.READ, target_hostname, buffers, peer_buffer_addresses, lengths)

    def batch_transfer_sync(self, target_hostname: str, buffers: Sequence[int],
                            peer_buffer_addresses: Sequence[int], lengths: Sequence[int],
                            opcode: TransferOpcode, notify: TransferNotify | None = None,
                            transport_hint: str = "") -> int:
        return self._sync(_OPS[TransferOpcode(opcode)], target_hostname, buffers,
                          peer_buffer_addresses, lengths)

    def _sync(self, op: OpCode, target: str, buffers: Sequence[int], peers: Sequence[int],
              lengths: Sequence[int]) -> int:
        requests = self._requests(op, target, buffers, peers, lengths)
        if requests is None:
            return ERR_INVALID_ARGUMENT
        try:
            statuses = self.native.transfer_sync(requests)
        except KvpoolError as exc:
            log.warning("transfer to %s failed: %s", target, exc)
            return ERR_INVALID_ARGUMENT
        failed = [s.reason for s in statuses if not s.ok]
        if failed:
            log.warning("%d of %d transfers to %s failed: %s", len(failed), len(statuses),
                        target, failed[0])
            return ERR_INVALID_ARGUMENT
        return OK

    # -- asynchronous ----------------------------------------------------------------------

    def batch_transfer_async_write(self, target_hostname: str, buffers: Sequence[int],
                                   peer_buffer_addresses: Sequence[int], lengths: Sequence[int],
                                   transport_hint: str = "") -> int:
        return self._submit(OpCode.WRITE, target_hostname, buffers, peer_buffer_addresses,
                            lengths)

    def batch_transfer_async_read(self, target_hostname: str, buffers: Sequence[int],
                                  peer_buffer_addresses: Sequence[int], lengths: Sequence[int],
                                  transport_hint: str = "") -> int:
        return self._submit(OpCode.READ, target_hostname, buffers, peer_buffer_addresses,
                            lengths)

    def batch_transfer_async(self, target_hostname: str, buffers: Sequence[int],
                             peer_buffer_addresses: Sequence[int], lengths: Sequence[int],
                             opcode: TransferOpcode, transport_hint: str = "") -> int:
        return self._submit(_OPS[TransferOpcode(opcode)], target_hostname, buffers,
                            peer_buffer_addresses, lengths)

    def transfer_submit_write(self, target_hostname: str, buffer: int, peer_buffer_address: int,
                              length: int, transport_hint: str = "") -> int:
        return self._submit(OpCode.WRITE, target_hostname, [buffer], [peer_buffer_address],
                            [length])

    def _submit(self, op: OpCode, target: str, buffers: Sequence[int], peers: Sequence[int],
                lengths: Sequence[int]) -> int:
        """A batch id (> 0), or 0 when the requests could not be submitted."""
        requests = self._requests(op, target, buffers, peers, lengths)
        if requests is None:
            return 0
        try:
            batch_id = self.native.allocate_batch(max(1, len(requests)))
            self.native.submit(batch_id, requests)
        except KvpoolError as exc:
            log.warning("submit to %s failed: %s", target, exc)
            return 0
        self._deadlines[batch_id] = self.clock.now() + self.native.config.timeout_s * 2
        return batch_id

    def transfer_check_status(self, batch_id: int, /) -> int:
        """1 done, 0 running, -1 failed (or unknown id), -2 timed out. A finished batch is
        forgotten once reported, as in Mooncake."""
        deadline = self._deadlines.get(batch_id)
        if deadline is None:
            return CHECK_FAILED
        states = {s.state for s in self.native.status(batch_id)}
        if RequestState.PENDING in states:
            if self.clock.now() < deadline:
                return CHECK_RUNNING
            self._forget(batch_id)
            return CHECK_TIMEOUT
        self._forget(batch_id)
        return CHECK_FAILED if RequestState.FAILED in states else CHECK_DONE

    def get_batch_transfer_status(self, batch_ids: Sequence[int], /) -> int:
        """Wait for every batch; 0 when all succeeded, -1 otherwise. The batches are freed."""
        ok = True
        for batch_id in batch_ids:
            deadline = self._deadlines.get(batch_id)
            if deadline is None:
                ok = False
                continue
            statuses = self.native.wait(batch_id, max(0.0, deadline - self.clock.now()))
            ok = ok and all(s.ok for s in statuses)
            self._forget(batch_id)
        return OK if ok else ERR_INVALID_ARGUMENT

    def _forget(self, batch_id: int) -> None:
        self._deadlines.pop(batch_id, None)
        try:
            self.native.free_batch(batch_id)
        except KvpoolError:
            pass
