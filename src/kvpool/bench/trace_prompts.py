"""Pieces the serving benchmarks share: prompts from a trace's hash ids, and percentiles."""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass

TRACE_BLOCK_TOKENS = 512
"""Tokens one hash id of a Mooncake trace stands for."""


def block_ids(hash_id: int, block_tokens: int, vocab: range) -> list[int]:
    """The token ids of one trace block: a fixed run seeded by its hash id."""
    rng = random.Random(hash_id)
    return [rng.randrange(vocab.start, vocab.stop) for _ in range(block_tokens)]


@dataclass(frozen=True)
class BenchRequest:
    """One request of a replay: when it is sent, its prompt, its output length."""

    arrival_s: float
    prompt_ids: list[int]
    max_tokens: int


def pct(values: list[float], q: int) -> float:
    if not values:
        return 0.0
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]
