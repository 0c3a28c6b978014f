"""Next-token choice per sequence, and the logprobs a request asks for.

    raw logits -> logit_bias, min_tokens, penalties -> greedy (temperature 0) or
                  temperature, top-k, top-p with the sequence's own seeded generator
                  (so a seed gives the same tokens in any batch)
    raw logits -> log-softmax -> the chosen token's logprob and the top alternatives

Logprobs come from the raw logits (before the processors), as vLLM reports them by default.
"""

from __future__ import annotations

from collections.abc import Collection

import torch

from kvpool.engine.config import SamplingParams
from kvpool.engine.sequence import Sampled, Sequence, TokenLogprob

PROMPT_ROWS = 256
"""Prompt positions turned into logprobs at a time (bounds the [rows, vocab] buffer)."""


def choose(logits: torch.Tensor, seq: Sequence, eos_ids: Collection[int]) -> Sampled:
    """logits [vocab] float32 of `seq`'s last token -> its next token (and logprob)."""
    params = seq.sampling
    scores = processed(logits, seq, eos_ids)
    token = sample(scores, params, seq.sampling_generator())
    if params.logprobs is None:
        return Sampled(token)
    return Sampled(token, logprobs_of(logits[None, :], [token], params.logprobs)[0])


def processed(logits: torch.Tensor, seq: Sequence, eos_ids: Collection[int]) -> torch.Tensor:
    """The logits after logit_bias, min_tokens and the penalties (`logits` itself if none
    applies)."""
    p = seq.sampling
    out = logits
    if p.logit_bias:
        out = out.clone()
        ids, biases = p.bias_tensors
        keep = ids < out.numel()
        out[ids[keep]] += biases[keep].to(dtype=out.dtype, device=out.device)
    if len(seq.output_ids) < p.min_tokens:
        out = out.clone() if out is logits else out
        stops = p.stop_tensor
        out[stops[stops < out.numel()]] = float("-inf")
        if not p.ignore_eos:
            out[[t for t in eos_ids if t < out.numel()]] = float("-inf")
    if p.repetition_penalty != 1.0:
        out = _repetition(out, seq.token_ids, p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and seq.output_ids:
        outs = torch.tensor(seq.output_ids, device=out.device)
        counts = torch.bincount(outs, minlength=out.numel())[:out.numel()]
        out = out - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)
    return out


def _repetition(scores: torch.Tensor, token_ids: list[int], penalty: float) -> torch.Tensor:
    seen = torch.unique(torch.tensor(token_ids, device=scores.device))
    seen = seen[seen < scores.numel()]
    vals = scores[seen]
    out = scores.clone()
    out[seen] = torch.where(vals > 0, vals / penalty, vals * penalty)
    return out


GREEDY_BELOW = 1e-5
"""A temperature this small samples greedily (as vLLM does): dividing the logits by it would
overflow them to inf, and the distribution it stands for is the argmax anyway."""


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """logits [vocab] float32 -> one token id."""
    if params.temperature < GREEDY_BELOW:
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


def logprobs_of(logits: torch.Tensor, tokens: list[int], k: int) -> list[TokenLogprob]:
    """logits [n, vocab] and the token at each row -> that token's logprob and the top `k`."""
    lsm = torch.log_softmax(logits.float(), dim=-1)
    chosen = lsm.gather(1, torch.tensor(tokens, device=lsm.device)[:, None])[:, 0].tolist()
    if k == 0:
        return [TokenLogprob(t, lp) for t, lp in zip(tokens, chosen, strict=True)]
    top = torch.topk(lsm, k, dim=-1)
    values, ids = top.values.tolist(), top.indices.tolist()
    return [TokenLogprob(t, lp, tuple(zip(ids[i], values[i], strict=True)))
            for i, (t, lp) in enumerate(zip(tokens, chosen, strict=True))]
