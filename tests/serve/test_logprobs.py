"""The logprobs objects' shapes (`kvpool.serve.logprobs`): a completions position's
`top_logprobs` has the most likely tokens and the chosen one (OpenAI: up to `logprobs` + 1)."""

from __future__ import annotations

from collections.abc import Sequence

from kvpool.engine.sequence import TokenLogprob
from kvpool.serve.logprobs import chat_logprobs, completion_logprobs

TEXTS = {1: "a", 2: "b", 3: "c", 4: "a"}  # 4 reads as 1 does


def decode(ids: Sequence[int]) -> str:
    return "".join(TEXTS[i] for i in ids)


def test_a_chosen_token_outside_the_top_ones_has_its_entry_too() -> None:
    entries = [TokenLogprob(1, -0.1, ((1, -0.1), (2, -2.5))),   # chosen among the top
               TokenLogprob(3, -4.0, ((1, -0.2), (2, -1.9))),   # sampled outside them
               TokenLogprob(2, -0.7, ()),                        # logprobs=0
               TokenLogprob(4, -3.0, ((1, -0.3),)),              # its text is a top one's
               None]                                             # an echo's first token
    got = completion_logprobs(decode, [1, 3, 2, 4, 1], entries)
    assert got["top_logprobs"] == [{"a": -0.1, "b": -2.5}, {"a": -0.2, "b": -1.9, "c": -4.0},
                                   {"b": -0.7}, {"a": -0.3}, None]
    assert got["token_logprobs"] == [-0.1, -4.0, -0.7, -3.0, None]


def test_chat_top_logprobs_stay_the_top_ones() -> None:
    """Chat reports the chosen token beside its `top_logprobs`, which are the N asked."""
    got = chat_logprobs(decode, [TokenLogprob(3, -4.0, ((1, -0.2), (2, -1.9)))])
    entry = got["content"][0]
    assert (entry["token"], entry["logprob"]) == ("c", -4.0)
    assert [t["token"] for t in entry["top_logprobs"]] == ["a", "b"]
