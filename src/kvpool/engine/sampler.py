"""Next-token choice per sequence: greedy at temperature 0, else temperature, top-k and top-p
with the sequence's own seeded generator (so a seed gives the same tokens in any batch)."""

from __future__ import annotations

import torch

from kvpool.engine.config import SamplingParams


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """logits [vocab] float32 -> one token id."""
    if params.temperature == 0:
        return int(torch.argmax(logits))
    scores = logits.cpu() / params.temperature
    if 0 < params.top_k < scores.numel():
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass ahead of each token
        sorted_probs[before >= params.top_p] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))
