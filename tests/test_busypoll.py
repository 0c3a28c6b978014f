"""Busy polling (kvpool.busypoll): the window's policy, and the polling reads over real
socket pairs and a real selector."""

from __future__ import annotations

import selectors
import socket
import threading
import time

import pytest

from kvpool import busypoll
from kvpool.busypoll import (
    NEVER,
    PollWindow,
    recv_into_polling,
    recv_polling,
    select_polling,
)


@pytest.fixture(autouse=True)
def _no_crowd(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests are about the window and the reads: a loaded test machine must not make
    their windows stand aside (tests/test_busypoll_crowded.py tests that)."""
    monkeypatch.setattr(busypoll, "CROWDED_GAP_S", float("inf"))
    monkeypatch.setattr(busypoll.CROWD, "resume_at", 0.0)


def test_a_window_polls_while_waits_end_within_it_and_stops_after_a_longer_one() -> None:
    window = PollWindow(300)
    assert window.budget_s() == pytest.approx(300e-6)  # a new connection starts hot
    window.observe(250e-6)
    assert window.budget_s() == pytest.approx(300e-6)
    window.observe(301e-6)
    assert window.budget_s() == 0.0  # an idle connection costs no CPU
    window.observe(5.0)
    assert window.budget_s() == 0.0
    window.observe(10e-6)  # requests come back to back again
    assert window.budget_s() == pytest.approx(300e-6)


def test_a_zero_window_never_polls_and_bad_windows_are_refused() -> None:
    window = PollWindow(0)
    window.observe(0.0)
    assert window.budget_s() == 0.0
    assert NEVER.budget_s() == 0.0
    with pytest.raises(ValueError, match="poll window"):
        PollWindow(-1)
    with pytest.raises(ValueError, match="poll window"):
        PollWindow(100_001)


@pytest.fixture
def pair() -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair()
    yield a, b
    a.close()
    b.close()


def _send_later(sock: socket.socket, data: bytes, delay_s: float) -> threading.Thread:
    thread = threading.Thread(target=lambda: (time.sleep(delay_s), sock.sendall(data)))
    thread.start()
    return thread


def test_data_that_comes_while_polling_is_read_and_keeps_the_window_hot(pair) -> None:
    a, b = pair
    window = PollWindow(50_000)  # 50 ms: the sender's 2 ms comes within it
    sender = _send_later(b, b"reply", 0.002)
    assert recv_polling(a, 100, window) == b"reply"
    sender.join()
    assert window.budget_s() == pytest.approx(0.05)


def test_data_that_comes_after_the_window_is_read_by_blocking_and_cools_it(pair) -> None:
    a, b = pair
    window = PollWindow(1000)
    sender = _send_later(b, b"late", 0.05)
    view = memoryview(bytearray(16))
    got = recv_into_polling(a, view, window)
    sender.join()
    assert bytes(view[:got]) == b"late"
    assert window.budget_s() == 0.0


def test_bytes_already_there_are_read_at_once_and_a_close_reads_empty(pair) -> None:
    a, b = pair
    b.sendall(b"ready")
    assert recv_polling(a, 100, PollWindow(1000)) == b"ready"
    b.close()
    assert recv_polling(a, 100, PollWindow(1000)) == b""
    assert recv_polling(a, 100, NEVER) == b""


def test_a_blocking_read_still_times_out_under_a_kernel_timeout(pair) -> None:
    a, _ = pair
    a.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, b"\0" * 8 + (20_000).to_bytes(8, "little"))
    window = PollWindow(1000)
    start = time.monotonic()
    with pytest.raises(BlockingIOError):
        recv_polling(a, 100, window)
    assert 0.015 < time.monotonic() - start < 1.0


def test_select_polling_sees_a_ready_socket_and_an_idle_timeout_cools_the_window(pair) -> None:
    a, b = pair
    with selectors.DefaultSelector() as sel:
        sel.register(a, selectors.EVENT_READ)
        window = PollWindow(20_000)
        sender = _send_later(b, b"x", 0.002)
        ready = select_polling(sel, 1.0, window)
        sender.join()
        assert [key.fileobj for key, _ in ready] == [a]
        assert window.budget_s() == pytest.approx(0.02)
        a.recv(10)
        assert select_polling(sel, 0.03, window) == []  # idle longer than the window
        assert window.budget_s() == 0.0
        window.observe(0.0)
        assert select_polling(sel, 0.0, window) == []  # a due tick says nothing of idleness
        assert window.budget_s() == pytest.approx(0.02)


def test_only_half_the_cpus_worth_of_threads_poll_at_once_the_others_block(
        pair, monkeypatch) -> None:
    a, b = pair
    polls: list[int] = []
    monkeypatch.setattr(busypoll, "_yield", lambda: polls.append(1))
    sender = _send_later(b, b"x", 0.01)
    assert recv_polling(a, 10, PollWindow(50_000)) == b"x"
    sender.join()
    assert polls  # with a slot free, the wait polled
    polls.clear()
    held = [slot for slot in busypoll._SLOTS if slot.acquire(False)]
    try:
        sender = _send_later(b, b"y", 0.01)
        assert recv_polling(a, 10, PollWindow(50_000)) == b"y"  # blocked, still got its bytes
        sender.join()
        assert not polls
    finally:
        for slot in held:
            slot.release()
    assert all(slot.acquire(False) for slot in busypoll._SLOTS)  # every slot was given back
    for slot in busypoll._SLOTS:
        slot.release()
