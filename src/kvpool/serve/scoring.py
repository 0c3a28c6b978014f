"""Scoring a prompt: `echo: true` with `max_tokens: 0` on /v1/completions, OpenAI's way to ask
for a prompt's logprobs without a completion (lm-evaluation-harness's loglikelihood requests).

Each choice runs for one token, because the engine reports the prompt's logprobs with the first
token (kvpool.serve.requests sets `max_tokens` 1 and `PreparedRequest.score_only`); the token is
dropped here, and its stream closed at once (which releases the request on its workers).
The response holds the prompt as the choice's text, its logprobs when `logprobs` is set (the
first token's null, as OpenAI's), `finish_reason` "length" and no completion token; streamed,
one chunk with the prompt, one with the finish reason per choice, then the usage chunk if
asked and `[DONE]`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from kvpool.serve.cancel import close_all
from kvpool.serve.logprobs import completion_logprobs
from kvpool.serve.protocol import SSE_DONE, choice_body, chunk, full_response, sse, usage_chunk
from kvpool.serve.requests import PreparedRequest, Proxy
from kvpool.serve.responses import Choice, usage_of

FINISH = "length"


async def end_runs(choices: list[Choice]) -> None:
    """Close every choice's token stream (its one token is not part of the answer)."""
    await close_all(*(c.chunks for c in choices))
    for c in choices:
        c.finish = FINISH


def _prompt_logprobs(proxy: Proxy, prep: PreparedRequest, c: Choice) -> dict[str, Any] | None:
    if prep.logprobs is None:
        return None
    prompt = c.job.prompt_ids
    return completion_logprobs(proxy.tokenizer.decode, prompt,
                               c.run.prompt_logprobs or [None] * len(prompt))


async def scored_body(proxy: Proxy, prep: PreparedRequest,
                      choices: list[Choice]) -> dict[str, Any]:
    """The whole response of a scoring request."""
    await end_runs(choices)
    bodies = [choice_body(prep.kind, c.job.index, proxy.tokenizer.decode(c.job.prompt_ids),
                          FINISH, _prompt_logprobs(proxy, prep, c)) for c in choices]
    return full_response(prep.kind, prep.request_id, proxy.model_name, bodies,
                         usage_of(prep, choices))


async def scored_events(proxy: Proxy, prep: PreparedRequest,
                        choices: list[Choice]) -> AsyncIterator[bytes]:
    """The SSE events of a streamed scoring request."""
    await end_runs(choices)
    kind, rid, model = prep.kind, prep.request_id, proxy.model_name
    for c in choices:
        text = proxy.tokenizer.decode(c.job.prompt_ids)
        yield sse(chunk(kind, rid, model, text, None, index=c.job.index,
                        logprobs=_prompt_logprobs(proxy, prep, c)))
        yield sse(chunk(kind, rid, model, None, FINISH, index=c.job.index))
    if prep.include_usage:
        yield sse(usage_chunk(kind, rid, model, usage_of(prep, choices)))
    yield SSE_DONE
