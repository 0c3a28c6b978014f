"""The client's copy plan: exact copies for one and several parts, and the transfer request
each copy becomes."""

from __future__ import annotations

from kvpool.store.client.plan import Copy, copies_for
from kvpool.store.wire.codes import ReplicaDesc
from kvpool.transfer import OpCode, TransferRequest

REPLICA = ReplicaDesc("seg", "10.0.0.2:7000", 1 << 20, 300, fence=9)


def test_one_part_is_one_copy_of_the_object_bytes() -> None:
    assert copies_for([(4096, 500)], REPLICA, 300) == [
        Copy(4096, 300, "10.0.0.2:7000", 1 << 20, 9)]
    assert copies_for([(4096, 200)], REPLICA, 300) == [
        Copy(4096, 200, "10.0.0.2:7000", 1 << 20, 9)]
    assert copies_for([(4096, 200)], REPLICA, 0) == []


def test_parts_are_laid_out_in_order_and_the_tail_is_left_alone() -> None:
    parts = [(4096, 100), (8192, 0), (9000, 150), (20000, 400)]
    assert copies_for(parts, REPLICA, 300) == [
        Copy(4096, 100, "10.0.0.2:7000", (1 << 20), 9),
        Copy(9000, 150, "10.0.0.2:7000", (1 << 20) + 100, 9),
        Copy(20000, 50, "10.0.0.2:7000", (1 << 20) + 250, 9)]


def test_a_copy_is_a_transfer_request_without_its_op() -> None:
    copy = Copy(4096, 300, "10.0.0.2:7000", 1 << 20, 9)
    assert copy.request(OpCode.READ) == TransferRequest(
        OpCode.READ, local_addr=4096, length=300, target="10.0.0.2:7000",
        target_addr=1 << 20, fence=9)
    assert list(Copy._fields) == [f for f in TransferRequest._fields if f != "op"]
