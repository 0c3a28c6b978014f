"""When a supervised child process that exited is started again, and when to give up on it.

Sans-I/O policy on an injected clock: `RestartPolicy.on_exit()` is told that the child exited
and answers `Restart(attempt, delay_s)` or `GiveUp(...)`; it never sleeps, signals or spawns
(kvpool.supervisor does, on the real clock). One policy object per child.

The schedule: the n-th restart within the last `window_s` waits
`min(max_delay_s, first_delay_s * factor ** (n - 1))`. Restarts older than `window_s` are
forgotten, so a child that has run quietly for a window starts over at `first_delay_s`. The
budget: an exit with `max_restarts` restarts already inside the window is not restarted
(`GiveUp`); `max_restarts` 0 gives up on the first exit.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from kvpool.clock import SYSTEM_CLOCK, Clock
from kvpool.errors import ConfigError


@dataclass(frozen=True)
class RestartConfig:
    first_delay_s: float = 1.0
    """Wait before the first restart in a window (a crashed worker's port is free again)."""
    factor: float = 2.0
    """Each further restart in the window waits this many times longer (>= 1)."""
    max_delay_s: float = 30.0
    """No wait is longer than this."""
    max_restarts: int = 5
    """Restarts allowed within `window_s`; the next exit gives up (0: never restart)."""
    window_s: float = 300.0
    """How long a restart counts against the budget and the backoff."""

    def __post_init__(self) -> None:
        if self.first_delay_s < 0 or self.max_delay_s < self.first_delay_s:
            raise ConfigError(f"restart delays need 0 <= first_delay_s ({self.first_delay_s}) "
                              f"<= max_delay_s ({self.max_delay_s})")
        if self.factor < 1:
            raise ConfigError(f"restart backoff factor must be >= 1, not {self.factor}")
        if self.max_restarts < 0:
            raise ConfigError(f"max_restarts must be >= 0, not {self.max_restarts}")
        if self.window_s <= 0:
            raise ConfigError(f"the restart window must be > 0 s, not {self.window_s}")

    def delay_s(self, attempt: int) -> float:
        """The wait before restart number `attempt` (1-based) within a window."""
        return min(self.max_delay_s, self.first_delay_s * self.factor ** (attempt - 1))


@dataclass(frozen=True)
class Restart:
    attempt: int
    """This restart's number within the window (1 = the first)."""
    delay_s: float
    """Wait this long, then start the child again."""


@dataclass(frozen=True)
class GiveUp:
    num_restarts: int
    """Restarts within the window when the child exited once more."""
    window_s: float


class RestartPolicy:
    """The restart schedule and budget of one child. The only writer of its restart times."""

    def __init__(self, config: RestartConfig, clock: Clock = SYSTEM_CLOCK) -> None:
        self.config = config
        self.clock = clock
        self._recent: deque[float] = deque()
        """When each restart within the window was decided, oldest first."""
        self.num_restarts = 0
        """Restarts decided since this policy was made (the window forgets; this does not)."""

    def on_exit(self) -> Restart | GiveUp:
        """The child exited: restart it (after `delay_s`) or give up. A Restart is counted
        at once, against the window and `num_restarts`."""
        now = self.clock.now()
        self._forget_before(now - self.config.window_s)
        if len(self._recent) >= self.config.max_restarts:
            return GiveUp(len(self._recent), self.config.window_s)
        self._recent.append(now)
        self.num_restarts += 1
        attempt = len(self._recent)
        return Restart(attempt, self.config.delay_s(attempt))

    @property
    def num_recent(self) -> int:
        """Restarts within the window ending now."""
        self._forget_before(self.clock.now() - self.config.window_s)
        return len(self._recent)

    def _forget_before(self, t: float) -> None:
        while self._recent and self._recent[0] <= t:
            self._recent.popleft()
