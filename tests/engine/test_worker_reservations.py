"""A decode worker's KV reservations (`worker/reservations.py`) on a virtual clock: deadlines,
taking, expiry, the integrity check; then a worker that gives expired blocks back."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from kvpool.clock import VirtualClock
from kvpool.engine.config import EngineConfig
from kvpool.engine.worker.app import create_app
from kvpool.engine.worker.reservations import Reservation, Reservations
from kvpool.engine.worker.runtime import Worker, WorkerConfig
from kvpool.errors import InvalidArgument

AUTH = {"Authorization": "Bearer s3cret"}


def test_a_reservation_is_held_until_its_deadline_then_expires() -> None:
    clock = VirtualClock(100.0)
    table = Reservations(ttl_s=60.0, clock=clock)
    assert table.add("a", [3, 4]) == Reservation([3, 4], 160.0)
    clock.advance(10.0)
    table.add("b", [5])
    table.check_integrity()
    assert list(table) == ["a", "b"] and "a" in table and len(table) == 2
    clock.advance(50.0)                      # now 160: "a" ends at 160, not before
    assert table.retire_expired() == []
    clock.advance(0.5)
    assert table.retire_expired() == ["a"] and table.release_due() == [[3, 4]]
    assert "a" not in table and table.get("b") == Reservation([5], 170.0)
    clock.advance(20.0)
    assert table.retire_expired() == ["b"] and len(table) == 0
    assert table.release_due() == [[5]]
    table.check_integrity()


def test_expired_reservations_come_back_oldest_first() -> None:
    clock = VirtualClock()
    table = Reservations(ttl_s=5.0, clock=clock)
    for i, rid in enumerate(["c", "a", "b"]):
        table.add(rid, [i])
        clock.advance(1.0)
    clock.advance(10.0)
    assert table.retire_expired() == ["c", "a", "b"]
    assert table.release_due() == [[0], [1], [2]]


def test_blocks_not_taken_go_back_only_once_a_late_push_is_over() -> None:
    """An aborted or expired reservation's blocks may still be written by a push its prefill
    worker started before the deadline: they go back at deadline + grace_s, not before."""
    clock = VirtualClock()
    table = Reservations(ttl_s=10.0, clock=clock, grace_s=31.0)
    table.add("aborted", [1, 2])
    table.add("expired", [3])
    clock.advance(1.0)
    assert table.retire("aborted") and not table.retire("aborted")
    assert "aborted" not in table and table.release_due() == []
    clock.advance(9.5)
    assert table.retire_expired() == ["expired"] and table.release_due() == []
    table.check_integrity()
    clock.advance(30.0)                      # 40.5: 10 + 31 not passed
    assert table.release_due() == []
    clock.advance(1.0)
    assert table.release_due() == [[1, 2], [3]] and table.release_due() == []


def test_take_hands_the_blocks_over_once() -> None:
    table = Reservations(ttl_s=1.0, clock=VirtualClock())
    table.add("a", [7, 8])
    assert table.take("a") == [7, 8]
    assert table.take("a") is None and table.take("never") is None
    table.check_integrity()


def test_a_second_reservation_for_a_request_is_refused_and_changes_nothing() -> None:
    clock = VirtualClock()
    table = Reservations(ttl_s=1.0, clock=clock)
    table.add("a", [1])
    clock.advance(0.5)
    with pytest.raises(InvalidArgument, match="request a already holds a reservation"):
        table.add("a", [2])
    assert table.get("a") == Reservation([1], 1.0)
    with pytest.raises(InvalidArgument, match="ttl_s must be > 0"):
        Reservations(ttl_s=0.0)


def test_the_integrity_check_finds_a_block_held_twice() -> None:
    table = Reservations(ttl_s=1.0, clock=VirtualClock())
    table.add("a", [1, 2])
    table.add("b", [2, 3])
    with pytest.raises(AssertionError, match=r"block 2 reserved twice \(b\)"):
        table.check_integrity()
    table.take("b")
    table.add("c", [-1])
    with pytest.raises(AssertionError, match="c holds block id -1"):
        table.check_integrity()


def test_a_worker_gives_an_unused_reservation_back_when_it_expires(tiny_llama: Path) -> None:
    """On the worker's own clock: nothing expires at the deadline; the engine loop's next
    idle turn after it retires the reservation, and the blocks come back once a push its
    prefill worker may have started before the deadline is over (3 x remote_timeout_s + 1).
    (The loop runs `_expire` after each batch of commands, so a second command sent after
    the first has answered runs after it.)"""
    clock = VirtualClock()
    worker = Worker(WorkerConfig(str(tiny_llama), role="decode", token="s3cret",
                                 reserve_ttl_s=30.0,
                                 engine=EngineConfig(block_size=8, num_blocks=8,
                                                     max_model_len=64)), clock=clock)

    def free_tokens() -> int:
        return int(client.get("/load", headers=AUTH).json()["free_kv_tokens"])

    def one_idle_turn() -> None:
        for _ in range(2):
            worker.loop.call(lambda engine: None).result(timeout=5)

    with TestClient(create_app(worker)) as client:
        one = client.post("/kv/reserve", json={"request_id": "a", "num_tokens": 20},
                          headers=AUTH)
        assert one.status_code == 200 and free_tokens() == 5 * 8
        assert worker.reservations.get("a") == Reservation([0, 1, 2], 30.0)
        clock.advance(30.0)
        one_idle_turn()
        assert "a" in worker.reservations and free_tokens() == 5 * 8
        clock.advance(0.1)
        one_idle_turn()
        assert len(worker.reservations) == 0 and free_tokens() == 5 * 8
        clock.advance(3 * worker.config.remote_timeout_s + 1.0)
        one_idle_turn()
        assert free_tokens() == 8 * 8
        worker.reservations.check_integrity()
