"""Per-topic sequence numbers of a KV-event stream: what each arriving message means.

Sans-I/O. The driver shows every message's (topic, seq) to `observe` and acts on the verdict:

    FIRST    the topic was never seen: the instance joins; resync it (clear, replay from 0)
    IN_ORDER seq is the next one: apply the message
    GAP      seqs [missing_from, seq) were lost: replay them, else resync; then apply
    RESTART  seq went back to 0: the publisher restarted with an empty cache; resync
    STALE    seq was already seen (a duplicate after a replay): drop it

`observe` moves the expected seq past the message for every verdict but STALE, so the
tracker never waits on a message the driver gave up on.
"""

from __future__ import annotations

import enum
from typing import NamedTuple


class Verdict(enum.Enum):
    FIRST = "first"
    IN_ORDER = "in_order"
    GAP = "gap"
    RESTART = "restart"
    STALE = "stale"


class Observation(NamedTuple):
    verdict: Verdict
    missing_from: int = 0
    """For GAP: the first lost seq (the lost range is [missing_from, seq))."""


class SequenceTracker:
    def __init__(self) -> None:
        self._next: dict[bytes, int] = {}

    def observe(self, topic: bytes, seq: int) -> Observation:
        expected = self._next.get(topic)
        if expected is None:
            verdict = Observation(Verdict.FIRST)
        elif seq == expected:
            verdict = Observation(Verdict.IN_ORDER)
        elif seq > expected:
            verdict = Observation(Verdict.GAP, expected)
        elif seq == 0:
            verdict = Observation(Verdict.RESTART)
        else:
            return Observation(Verdict.STALE)
        self._next[topic] = seq + 1
        return verdict

    def expected(self, topic: bytes) -> int | None:
        """The next seq awaited on `topic` (None: never seen)."""
        return self._next.get(topic)

    def advance(self, topic: bytes, seq: int) -> None:
        """Note that `seq` was applied out of band (a replayed message)."""
        if seq + 1 > self._next.get(topic, 0):
            self._next[topic] = seq + 1

    def forget(self, topic: bytes) -> None:
        self._next.pop(topic, None)
