"""`kvpool bench prompts`: what a prompt costs the proxy before it is scheduled (its token ids
and its blocks' hashes): kvpool's way (`ModelTokenizer`, which remembers the pieces of prompts
between special tokens, serve/token_cache.py; vLLM's sha256_cbor chain through its memo,
kvevents/hashing.py) beside the `tokenizers` library encoding each prompt whole and every block
hashed (the anchor: the same tokenizer and chain with nothing remembered), in the same run, on
the same prompts:

    chat     conversations that grow a turn at a time, each request the whole conversation
             so far as the chat API sends it (the turns sent before are looked up), the
             conversations' requests interleaved as a server sees them
    unique   completion prompts that no request repeats (every piece missed: what the cache
             costs where it cannot help)

Every request's ids and hashes are checked against the anchor's; the rounds alternate the two
and the figures are each one's median over them.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any

from kvpool.engine.blocks import prefix_block_hashes
from kvpool.kvevents.hashing import BlockHasher
from kvpool.serve.tokenizer import DEFAULT_CACHE_BYTES, ModelTokenizer

BLOCK_SIZE = 16
ROOT = 0x6B76706F6F6C
"""The chain's root (a model identity's stands in: any 64-bit value costs the same)."""

_WORDS = ("the pool keeps every block of the cache so that a prefix computed once is reused "
          "by any instance of the cluster while the conductor picks where each request runs "
          "and what it costs to move its blocks over the network or read them from disk "
          "été 中文 12345").split()


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("prompts", help="a prompt's ids and block hashes on the proxy, "
                              "its pieces remembered, beside the library encoding each whole")
    p.add_argument("--model", default="tiny", help="tiny, smollm2 or a model folder")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=16, help="requests per conversation")
    p.add_argument("--message-words", type=int, default=150, help="words per message")
    p.add_argument("--unique", type=int, default=400, help="unique completion prompts")
    p.add_argument("--chain", choices=CHAINS, default="kvpool",
                   help="the blocks' hashes: kvpool workers' chain, or vLLM's (its "
                   "--prefix-caching-hash-algo) as the proxy computes it for KV events")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", action="store_true", help="one JSON object per row")
    p.set_defaults(func=_main)


def _message(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words)) + "."


def chat_texts(tok: ModelTokenizer, conversations: int, turns: int, words: int) -> list[str]:
    """Each request's rendered prompt: turn t of every conversation, then turn t + 1."""
    rng = random.Random(1)
    convs = [[{"role": "system", "content": f"You are assistant {c}. " + _message(rng, words)}]
             for c in range(conversations)]
    texts = []
    for _ in range(turns):
        for conv in convs:
            conv.append({"role": "user", "content": _message(rng, words)})
            texts.append(tok.render_chat(conv))
            conv.append({"role": "assistant", "content": _message(rng, words)})
    return texts


def unique_texts(count: int, words: int) -> list[str]:
    rng = random.Random(2)
    return [f"{i}: {_message(rng, words)}" for i in range(count)]


CHAINS = ("kvpool", "sha256", "sha256_cbor")


class Chain:
    """A prompt's blocks' hashes as the proxy makes them for one backend: kvpool's chain
    (never remembered: a lookup costs about what a block's hash does), or vLLM's (a
    `BlockHasher`, whose sha256_cbor chain is remembered unless `memo_bytes` is 0)."""

    def __init__(self, kind: str, memo_bytes: int) -> None:
        self._hasher = None if kind == "kvpool" else \
            BlockHasher(kind, BLOCK_SIZE, memo_bytes=memo_bytes)  # type: ignore[arg-type]

    def __call__(self, ids: list[int]) -> list[Any]:
        if self._hasher is not None:
            return self._hasher.block_hashes(ids)
        return prefix_block_hashes(ids, BLOCK_SIZE, ROOT)

    def looked_up(self) -> float:
        """The share of blocks whose hash was looked up."""
        h = self._hasher
        hits, misses = (h.memo_hits, h.memo_misses) if h is not None else (0, 0)
        return hits / max(1, hits + misses)


def _timed(tok: ModelTokenizer, chain: Chain, texts: list[str],
           add_special_tokens: bool) -> tuple[float, list[tuple[list[int], list[Any]]]]:
    start = time.perf_counter()
    out = []
    for t in texts:
        ids = tok.encode(t, add_special_tokens)
        out.append((ids, chain(ids)))
    return time.perf_counter() - start, out


def measure(model: str, texts: list[str], add_special_tokens: bool,
            rounds: int, chain: str = "kvpool") -> dict[str, Any]:
    from kvpool.serve.models import resolve_model

    folder = resolve_model(model)
    anchor = ModelTokenizer(folder, cache_bytes=0)
    took: dict[str, list[float]] = {"library": [], "kvpool": []}
    for r in range(rounds):
        ours = ModelTokenizer(folder)  # a cache as a proxy starts with: empty
        memo = Chain(chain, DEFAULT_CACHE_BYTES)
        ways = {"library": (anchor, Chain(chain, 0)), "kvpool": (ours, memo)}
        got = {}
        for name in ("library", "kvpool") if r % 2 == 0 else ("kvpool", "library"):
            took_s, got[name] = _timed(*ways[name], texts, add_special_tokens)
            took[name].append(took_s)
        if got["kvpool"] != got["library"]:
            raise AssertionError("kvpool gave other ids or hashes than the library and chain")
    want, c = got["library"], ours.cache
    hit = c.hit_tokens / max(1, c.hit_tokens + c.miss_tokens) if c is not None else 0.0
    n, tokens = len(texts), sum(len(ids) for ids, _ in want)
    lib_s, our_s = statistics.median(took["library"]), statistics.median(took["kvpool"])
    return {"requests": n, "tokens_per_request": round(tokens / n),
            "library_us_per_request": round(lib_s / n * 1e6, 1),
            "kvpool_us_per_request": round(our_s / n * 1e6, 1),
            "speed_up": round(lib_s / our_s, 2), "cached_share": round(hit, 3),
            "blocks_looked_up": round(memo.looked_up(), 3), "cache": c is not None}


def _main(args: argparse.Namespace) -> int:
    from kvpool.serve.models import resolve_model

    tok = ModelTokenizer(resolve_model(args.model), cache_bytes=0)
    loads = {"chat": (chat_texts(tok, args.conversations, args.turns, args.message_words),
                      False),
             "unique": (unique_texts(args.unique, args.message_words), True)}
    for name, (texts, add) in loads.items():
        row = {"load": name, "model": args.model, "chain": args.chain,
               **measure(args.model, texts, add, args.rounds, args.chain)}
        print(json.dumps(row) if args.json else _fmt(row), flush=True)
    return 0


def _fmt(r: dict[str, Any]) -> str:
    cache = "" if r["cache"] else "  (no cache: this tokenizer's pieces read differently alone)"
    return (f"{r['load']:<7} {r['chain']:<11} {r['requests']:5d} requests, "
            f"{r['tokens_per_request']:6d} tokens each: library {r['library_us_per_request']:9.1f} us/request, kvpool "
            f"{r['kvpool_us_per_request']:9.1f} us/request  x{r['speed_up']:.2f}  "
            f"({100 * r['cached_share']:.0f}% of the tokens looked up){cache}")
