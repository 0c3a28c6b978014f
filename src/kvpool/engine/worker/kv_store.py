"""What the pool connector (`worker/pool.py`) needs from the KV store and from the transfer
engine, as two small protocols. The connector is written against these and nothing more, so a
store or transport satisfies them by shape: `kvpool.store.client.StoreClient` and
`kvpool.transfer.TransferEngine` in a worker, an in-memory stand-in in the connector's tests.

Every address is a local, registered address (`KVLayout.layer_part` gives them); a part is
`(addr, num_bytes)`. Failures that belong to one object come back as values (`PutResult`,
`ReadResult`, `ErrorCode`), one per key, in key order; only a broken transport raises.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from kvpool.store.client.plan import Part
from kvpool.store.wire.codes import ErrorCode, PutResult, ReadResult

__all__ = ["KVStore", "KVTransport", "Part"]


@runtime_checkable
class KVStore(Protocol):
    """The pool as the connector uses it: scatter/gather puts and gets, and removal."""

    def batch_put_from_parts(self, keys: Sequence[str],
                             parts: Sequence[Sequence[Part]]) -> list[PutResult]:
        """Store object `keys[i]` as the concatenation of `parts[i]`, read from local memory.

        Changes: each key whose result is OK is in the pool afterwards; a key already there
        is left as it was (OK, `already_existed`) and its bytes are not written. The local
        ranges are only read, and may be reused once the call returns.
        Returns one `PutResult` per key, in order (no space: `NO_AVAILABLE_HANDLE`; mismatched
        lengths of `keys` and `parts`: `INVALID_PARAMS` for all). Does not raise for a refused
        object; a store that cannot be reached reports it in the codes too."""
        ...

    def batch_get_into_parts(self, keys: Sequence[str],
                             parts: Sequence[Sequence[Part]]) -> list[ReadResult]:
        """Copy object `keys[i]` into `parts[i]`, in order, until the object ends.

        Changes: only the local ranges of keys whose result is OK (their first `num_bytes`
        bytes); the pool is not changed, except that a replica whose bytes fail their checksum
        is reported and may be dropped (`CHECKSUM_MISMATCH`). The ranges of a failed key hold
        unspecified bytes. Returns one `ReadResult` per key, in order (`OBJECT_NOT_FOUND` for a
        key not stored; parts smaller than the object: `INVALID_PARAMS`)."""
        ...

    def remove(self, key: str, force: bool = False) -> ErrorCode:
        """Remove `key` from the pool. `force` removes it even under a read lease (ours
        included). Returns OK, `OBJECT_NOT_FOUND`, or why it stayed; never raises for those."""
        ...


@runtime_checkable
class KVTransport(Protocol):
    """The one-sided writes of a push (prefill -> the decode worker's reserved memory)."""

    def batch_write(self, target: str, items: list[tuple[int, int, int]]) -> None:
        """Write each `(local_addr, target_addr, num_bytes)` of `items` into segment `target`.

        Changes: the target's memory at every `target_addr`; the local ranges are only read.
        Raises `kvpool.errors.TransferError` when any write failed (an unknown segment, a
        closed peer, a range the target did not register); which of the other writes landed
        is then unspecified, so the caller treats the whole batch as failed."""
        ...
