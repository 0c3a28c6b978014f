"""What the proxy measured, kept for `GET /stats/samples` (the simulator-vs-live comparison of
`kvpool bench serve` refits the cost model from it).

    prefill: (input_len, prefix_len, prefill_s, alone)   one per prefill leg, as the worker
             reported it; `alone` = nothing else was queued on that worker when it was booked
    decode:  (batch, context_tokens, gap_s)               one per gap between two decode-leg
             tokens; batch and context are the conductor's view of the decode worker then

Both are bounded (the newest are kept); `num_prefill_samples` / `num_decode_samples` in the
JSON count every sample ever taken, so a reader that noted them before a replay takes exactly
the ones after it.
"""

from __future__ import annotations

from collections import deque
from typing import Any

MAX_SAMPLES = 100_000


class MeasuredSamples:
    def __init__(self, max_samples: int = MAX_SAMPLES) -> None:
        self.prefill: deque[tuple[int, int, float, bool]] = deque(maxlen=max_samples)
        self.decode: deque[tuple[int, int, float]] = deque(maxlen=max_samples)
        self.num_prefill = 0
        self.num_decode = 0

    def add_prefill(self, input_len: int, prefix_len: int, prefill_s: float, alone: bool) -> None:
        self.prefill.append((input_len, prefix_len, prefill_s, alone))
        self.num_prefill += 1

    def add_decode(self, batch: int, context_tokens: int, gap_s: float, count: int = 1) -> None:
        """`count` gaps of `gap_s` each (a frame of several tokens: its gap shared among
        them, one sample per token as frames of one would give)."""
        self.decode.extend([(batch, context_tokens, gap_s)] * count)
        self.num_decode += count

    def to_json(self) -> dict[str, Any]:
        return {"num_prefill_samples": self.num_prefill, "num_decode_samples": self.num_decode,
                "prefill": [list(s) for s in self.prefill],
                "decode": [list(s) for s in self.decode]}
