"""The transfer engine: registered memory, batched READ/WRITE between segments over tcp or shm."""

from kvpool.transfer.batch import OpCode, RequestState, RequestStatus, TransferRequest
from kvpool.transfer.config import TransferConfig
from kvpool.transfer.engine import TransferEngine
from kvpool.transfer.memory import Buffer

__all__ = [
    "Buffer",
    "OpCode",
    "RequestState",
    "RequestStatus",
    "TransferConfig",
    "TransferEngine",
    "TransferRequest",
]
