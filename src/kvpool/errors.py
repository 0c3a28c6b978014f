"""The one error hierarchy of kvpool.

Expected outcomes (no space, object missing, request rejected) are returned as typed values;
these exceptions are for misuse and broken links. Messages carry the offending values and,
where there is one, the fix.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvpool.store.wire.codes import ErrorCode


class KvpoolError(Exception):
    """Base of every error kvpool raises on purpose."""


class ConfigError(KvpoolError, ValueError):
    """A configuration value is out of bounds or malformed (raised at construction)."""


class CheckpointError(ConfigError):
    """A model checkpoint (folder or GGUF file) is missing, incomplete or does not match its
    config."""


class InvalidArgument(KvpoolError, ValueError):
    """A call got an argument it cannot accept (wrong size, unknown name, bad key)."""


class ProtocolError(KvpoolError):
    """A frame or message violates the wire protocol."""


class LocalProtocolError(ProtocolError):
    """We were asked to send something the protocol does not allow (our bug or misuse)."""


class RemoteProtocolError(ProtocolError):
    """The peer sent bytes that are not a valid frame; the connection must be dropped."""


class AuthError(KvpoolError):
    """The peer presented a wrong or missing shared token."""


class TransferError(KvpoolError):
    """A transfer could not be completed (peer gone, timeout, remote rejection)."""


class PeerUnavailable(TransferError):
    """The target segment cannot be reached (refused, dead, or unknown address)."""


class TransferTimeout(TransferError):
    """A transfer did not finish within its deadline."""


class SegmentNotFound(KvpoolError, LookupError):
    """No segment of that name is known to the metadata service."""


class MetadataError(KvpoolError):
    """The metadata service failed or answered something unexpected."""


class MemoryRegistrationError(KvpoolError, ValueError):
    """A buffer cannot be registered, or an address is not inside any registered buffer."""


class StoreError(KvpoolError):
    """The store master or a store client failed in a way that is not an expected outcome."""


class JournalWriteError(StoreError):
    """The master's journal could not write or sync records (a full disk, an I/O error, etcd
    unreachable). Nothing of the failed write is acknowledged. `may_have_landed`: the
    records may be in the journal all the same (etcd applied a transaction whose answer was
    lost, the log could not be cut back, an fsync failed after the write), so a replay may
    still find them until later records void them."""

    def __init__(self, message: str, may_have_landed: bool = True) -> None:
        super().__init__(message)
        self.may_have_landed = may_have_landed


class StateDamaged(StoreError):
    """The master's saved state is incomplete (a missing, emptied or cut snapshot that later
    logs depend on): starting on it would serve a fraction of the objects. Restart with
    --recover-partial to accept what is left."""


class RpcError(StoreError):
    """A control-plane RPC failed (timeout, unreachable master, malformed reply, or the master
    refused the whole request: then `status` is the reply's status, an ErrorCode value)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class RpcFailed(StoreError):
    """A store client's call to the master failed as a whole (timeout, broken connection, or
    the whole request refused); `code` is the ErrorCode the caller's per-key results carry."""

    def __init__(self, code: ErrorCode) -> None:
        super().__init__(f"the master call failed: {code.name}")
        self.code = code


class MetadataUnavailable(MetadataError):
    """The metadata service cannot be reached (refused, timed out, or every endpoint down)."""


class RpcTimeout(RpcError):
    """The master did not answer a control-plane RPC within its deadline."""


class WorkerCallError(KvpoolError):
    """A call to a worker failed: unreachable, an error status, a malformed reply, or an error
    line in its stream. `status` is the worker's HTTP status, if it answered."""

    def __init__(self, url: str, call: str, message: str, status: int | None = None) -> None:
        super().__init__(f"worker {url} {call}: {message}")
        self.status = status


class RequestFailed(KvpoolError):
    """A request ended on a worker with an error (the message says why)."""


class ShuttingDown(KvpoolError):
    """The worker's engine thread has stopped; nothing more can be submitted."""
