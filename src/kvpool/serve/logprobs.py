"""Token logprobs in OpenAI's two shapes (pure functions over the engine's `TokenLogprob`s).

    completions  {"tokens": [...], "token_logprobs": [...], "top_logprobs": [{text: lp}],
                  "text_offset": [...]}      (the first prompt token of an echo: nulls; a
                                             position's top ones and the chosen token)
    chat         {"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}

A token's text is its own decode (a byte-level token that is part of a character decodes to
U+FFFD, as with vLLM); `text_offset` counts characters of those texts from `offset`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvpool.engine.sequence import TokenLogprob

Decode = Callable[[Sequence[int]], str]


def completion_logprobs(decode: Decode, token_ids: Sequence[int],
                        entries: Sequence[TokenLogprob | None], offset: int = 0) -> dict[str, Any]:
    tokens = [decode([t]) for t in token_ids]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens,
            "token_logprobs": [None if e is None else e.logprob for e in entries],
            "top_logprobs": [None if e is None else _completion_top(decode, e)
                             for e in entries],
            "text_offset": offsets}


def _completion_top(decode: Decode, e: TokenLogprob) -> dict[str, float]:
    """The most likely tokens' logprobs by their text, and the chosen token's where it is not
    among them: OpenAI's completions give up to `logprobs` + 1 (vLLM's too), so a sampled
    token outside the top ones still has its entry, and `logprobs=0` gives the chosen one."""
    top = {decode([t]): lp for t, lp in e.top}
    if all(t != e.token_id for t, _ in e.top):
        top.setdefault(decode([e.token_id]), e.logprob)
    return top


def merge_completion(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One completions logprobs object from consecutive ones (an echoed prompt, the output)."""
    keys = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    return {k: [v for p in parts for v in p[k]] for k in keys}


def chat_logprobs(decode: Decode, entries: Sequence[TokenLogprob | None]) -> dict[str, Any]:
    return {"content": [_chat_entry(decode, e) for e in entries if e is not None],
            "refusal": None}


def _chat_entry(decode: Decode, e: TokenLogprob) -> dict[str, Any]:
    return {**_token(decode, e.token_id, e.logprob),
            "top_logprobs": [_token(decode, t, lp) for t, lp in e.top]}


def _token(decode: Decode, token_id: int, logprob: float) -> dict[str, Any]:
    text = decode([token_id])
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}
