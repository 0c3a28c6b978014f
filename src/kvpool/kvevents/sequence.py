"""Per-topic sequence numbers of a KV-event stream: what each arriving message means.

Sans-I/O. The driver shows every message's (topic, seq) to `observe` and acts on the verdict:

    FIRST    the topic was never seen: the instance joins; resync it (clear, replay from 0)
    IN_ORDER seq is the next one: apply the message
    GAP      seqs [missing_from, seq) were lost: replay them, else resync; then apply
    RESTART  seq went back: the publisher restarted (a new process counts from 0 again, and
             its first messages may be lost while it connects); resync

PUB/SUB never delivers a message twice (replayed messages come on another socket and are
noted with `advance`), so a seq below the expected one can only be a new counter.
`observe` moves the expected seq past the message, so the tracker never waits on a message
the driver gave up on.
"""

from __future__ import annotations

import enum
from typing import NamedTuple


class Verdict(enum.Enum):
    FIRST = "first"
    IN_ORDER = "in_order"
    GAP = "gap"
    RESTART = "restart"


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
        else:
            verdict = Observation(Verdict.RESTART)
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
