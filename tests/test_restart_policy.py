"""The restart schedule and budget of kvpool.restart_policy on a virtual clock: exact delays,
the cap, the window that forgets, the give-up, and bad configs refused."""

from __future__ import annotations

import re

import pytest

from kvpool.clock import VirtualClock
from kvpool.errors import ConfigError
from kvpool.restart_policy import GiveUp, Restart, RestartConfig, RestartPolicy


def test_delays_double_up_to_the_cap() -> None:
    clock = VirtualClock()
    policy = RestartPolicy(RestartConfig(first_delay_s=1, factor=2, max_delay_s=5,
                                         max_restarts=10, window_s=1000), clock)
    decisions = []
    for _ in range(6):
        decisions.append(policy.on_exit())
        clock.advance(1)
    assert decisions == [Restart(1, 1), Restart(2, 2), Restart(3, 4), Restart(4, 5),
                         Restart(5, 5), Restart(6, 5)]
    assert policy.num_restarts == 6 and policy.num_recent == 6


def test_gives_up_when_the_budget_is_spent_within_the_window() -> None:
    clock = VirtualClock()
    policy = RestartPolicy(RestartConfig(max_restarts=3, window_s=60), clock)
    for attempt in (1, 2, 3):
        assert policy.on_exit() == Restart(attempt, RestartConfig().delay_s(attempt))
        clock.advance(10)
    assert policy.on_exit() == GiveUp(3, 60)  # at t=30: all three restarts within 60 s
    assert policy.num_restarts == 3  # a give-up is no restart
    assert policy.on_exit() == GiveUp(3, 60)  # and stays one while the window holds them


def test_the_window_forgets_old_restarts_and_the_backoff_starts_over() -> None:
    clock = VirtualClock()
    policy = RestartPolicy(RestartConfig(first_delay_s=0.5, max_restarts=2, window_s=100),
                           clock)
    assert policy.on_exit() == Restart(1, 0.5)  # t=0
    clock.advance(60)
    assert policy.on_exit() == Restart(2, 1.0)  # t=60
    clock.advance(40)  # t=100: the restart at t=0 is exactly one window old, forgotten
    assert policy.num_recent == 1
    assert policy.on_exit() == Restart(2, 1.0)
    clock.advance(200)  # a quiet window: both forgotten
    assert policy.num_recent == 0
    assert policy.on_exit() == Restart(1, 0.5)
    assert policy.num_restarts == 4


def test_zero_restarts_gives_up_at_the_first_exit() -> None:
    policy = RestartPolicy(RestartConfig(max_restarts=0), VirtualClock())
    assert policy.on_exit() == GiveUp(0, RestartConfig().window_s)


def test_the_default_schedule() -> None:
    config = RestartConfig()
    assert [config.delay_s(n) for n in range(1, 8)] == [1, 2, 4, 8, 16, 30, 30]
    assert (config.max_restarts, config.window_s) == (5, 300)


@pytest.mark.parametrize("kwargs, words", [
    ({"first_delay_s": -1}, "first_delay_s (-1)"),
    ({"first_delay_s": 10, "max_delay_s": 5}, "<= max_delay_s (5)"),
    ({"factor": 0.5}, "factor must be >= 1, not 0.5"),
    ({"max_restarts": -1}, "max_restarts must be >= 0, not -1"),
    ({"window_s": 0}, "window must be > 0 s, not 0"),
])
def test_bad_configs_are_refused(kwargs: dict[str, float], words: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(words)):
        RestartConfig(**kwargs)  # type: ignore[arg-type]
