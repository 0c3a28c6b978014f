"""The emulated model: KV bytes as a function of the tokens, and tokens as a function of KV.

    row(p)   = W words of splitmix64(seed(p) + k * GOLDEN), k < W     one token's K (or V) of
    seed(p)  = mix(parent hash of p's block, p, token p)              one layer, XORed with a
                                                                      (layer, kind) constant
    digest   = xxh3_64 over the prompt's rows, layer by layer, K then V, block by block
    output j = ordinary token number splitmix64(digest + j)

So a block's KV depends on the prefix before it (its parent's chained hash, which covers the
model identity) and its own tokens, like a transformer's; and every output token depends on
every byte of the prompt's KV. An engine derives its tokens from the bytes in its own cache
(computed, loaded from the pool or pushed), while `expected_output` derives them from the tokens
alone: any KV that came from the wrong place, or was damaged on the way, changes the output.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import xxhash

from kvpool.engine.blocks import prefix_block_hashes

_GOLDEN, _MUL1, _MUL2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
"""splitmix64's constants, for both its forms (arrays and Python ints)."""
GOLDEN = np.uint64(_GOLDEN)
_M1, _M2 = np.uint64(_MUL1), np.uint64(_MUL2)
_S27, _S30, _S31, _S32 = np.uint64(27), np.uint64(30), np.uint64(31), np.uint64(32)
_MASK = (1 << 64) - 1


def splitmix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser over a uint64 array (wrapping arithmetic). Once per engine step
    on small arrays, so in place, with its constants made once: each numpy call here costs
    more than its arithmetic."""
    z = x + GOLDEN
    z ^= z >> _S30
    z *= _M1
    z ^= z >> _S27
    z *= _M2
    z ^= z >> _S31
    return z


def splitmix_int(x: int) -> int:
    """`splitmix` of one value, on Python ints (no array for a single token)."""
    z = (x + _GOLDEN) & _MASK
    z = ((z ^ (z >> 30)) * _MUL1) & _MASK
    z = ((z ^ (z >> 27)) * _MUL2) & _MASK
    return z ^ (z >> 31)


def ordinary_vocab(vocab_size: int) -> range:
    """Token ids an emulated model emits: the vocabulary past its first 16 (the specials of
    kvpool's tiny tokenizer sit there)."""
    return range(min(16, vocab_size // 2), vocab_size)


INT_WORDS = 32
"""`token_rows` of at most this many 8-byte words in all is made on Python ints: each numpy
call costs about a microsecond, more than a few words' arithmetic (a step of one decode,
80-byte rows: 21 -> about 5 us)."""


def token_rows(parents: np.ndarray | Sequence[int], positions: np.ndarray | Sequence[int],
               tokens: np.ndarray | Sequence[int], row_bytes: int) -> np.ndarray:
    """[n, row_bytes] uint8: the base rows of n tokens (before the layer/kind constant), from
    uint64 arrays or lists of ints (the same bytes either way)."""
    if len(tokens) * (row_bytes // 8) <= INT_WORDS:
        return _int_rows(_ints(parents), _ints(positions), _ints(tokens), row_bytes)
    with np.errstate(over="ignore"):
        seeds = splitmix(_u64(parents) ^ splitmix((_u64(positions) << _S32) ^ _u64(tokens)))
        rows = splitmix(seeds[:, None] + _words(row_bytes)[None, :])
    return rows.view(np.uint8).reshape(len(tokens), row_bytes)


def _int_rows(parents: Sequence[int], positions: Sequence[int], tokens: Sequence[int],
              row_bytes: int) -> np.ndarray:
    """`token_rows` on Python ints (wrapping as the arrays do)."""
    steps = _int_words(row_bytes)
    words: list[int] = []
    for parent, position, token in zip(parents, positions, tokens, strict=True):
        seed = splitmix_int(parent ^ splitmix_int(((position << 32) ^ token) & _MASK))
        words += [splitmix_int((seed + step) & _MASK) for step in steps]
    return np.array(words, dtype=np.uint64).view(np.uint8).reshape(len(tokens), row_bytes)


def _ints(values: np.ndarray | Sequence[int]) -> Sequence[int]:
    return values.tolist() if isinstance(values, np.ndarray) else values


def _u64(values: np.ndarray | Sequence[int]) -> np.ndarray:
    return values if isinstance(values, np.ndarray) else np.array(values, dtype=np.uint64)


@functools.cache
def _int_words(row_bytes: int) -> tuple[int, ...]:
    """`_words` as Python ints."""
    return tuple(int(w) for w in _words(row_bytes))


@functools.cache
def _words(row_bytes: int) -> np.ndarray:
    """k * GOLDEN for each 8-byte word k of a row (read-only: shared by every call)."""
    with np.errstate(over="ignore"):
        words = np.arange(row_bytes // 8, dtype=np.uint64) * GOLDEN
    words.flags.writeable = False
    return words


def layer_constant(layer: int, kind: int, row_bytes: int) -> np.ndarray:
    """[row_bytes] uint8 XORed onto the base rows of one layer's K (kind 0) or V (kind 1)."""
    with np.errstate(over="ignore"):
        word = splitmix(np.array([layer * 2 + kind + 1], dtype=np.uint64))
    return np.tile(word.view(np.uint8), row_bytes // 8)


RowKeys = tuple[np.ndarray, np.ndarray, np.ndarray]
"""(parent hashes, positions, tokens) of n token rows, uint64 each: what `token_rows` takes."""


def keys_for(token_ids: Sequence[int], start: int, stop: int, block_size: int,
             block_hashes: Sequence[int], root_hash: int) -> RowKeys:
    """The row keys of positions start..stop-1 of a sequence whose full blocks hash to
    `block_hashes` (those before `stop` must be known)."""
    positions = np.arange(start, stop, dtype=np.uint64)
    blocks = np.arange(start, stop) // block_size
    chain = np.array([root_hash, *block_hashes], dtype=np.uint64)
    parents = chain[np.minimum(blocks, len(chain) - 1)]
    tokens = np.asarray(token_ids[start:stop], dtype=np.int64).astype(np.uint64)
    return parents, positions, tokens


def rows_for(token_ids: Sequence[int], start: int, stop: int, block_size: int,
             block_hashes: Sequence[int], root_hash: int, row_bytes: int) -> np.ndarray:
    """Base rows of positions start..stop-1 (`keys_for`)."""
    return token_rows(*keys_for(token_ids, start, stop, block_size, block_hashes, root_hash),
                      row_bytes)


def output_tokens(digest: int, first: int, count: int, vocab: range) -> list[int]:
    """Output tokens first..first+count-1 of a prompt whose KV digests to `digest`."""
    return [vocab.start + splitmix_int((digest + j) & _MASK) % len(vocab)
            for j in range(first, first + count)]


NUMPY_FROM = 8
"""`next_tokens` of at least this many sequences goes through arrays (below it, the ints are
cheaper than making the arrays)."""


def next_tokens(digests: Sequence[int], positions: Sequence[int], vocab: range) -> list[int]:
    """Output token `positions[i]` of the prompt whose KV digests to `digests[i]`, for every i
    (`output_tokens` of one token each, a whole engine step's at once)."""
    if len(digests) < NUMPY_FROM:
        return [vocab.start + splitmix_int((d + j) & _MASK) % len(vocab)
                for d, j in zip(digests, positions, strict=True)]
    with np.errstate(over="ignore"):
        z = splitmix(np.array(digests, dtype=np.uint64) + np.array(positions, dtype=np.uint64))
    return (z % np.uint64(len(vocab)) + np.uint64(vocab.start)).tolist()


def digest_rows(chunks: Sequence[np.ndarray]) -> int:
    h = xxhash.xxh3_64()
    for chunk in chunks:
        h.update(np.ascontiguousarray(chunk).data)
    return h.intdigest()


def expected_digest(prompt: Sequence[int], block_size: int, root_hash: int, num_layers: int,
                    row_bytes: int) -> int:
    """The digest an engine's cache must hold for `prompt`, from the tokens alone."""
    hashes = prefix_block_hashes(prompt, block_size, root_hash)
    base = rows_for(prompt, 0, len(prompt), block_size, hashes, root_hash, row_bytes)
    parts = []
    for layer in range(num_layers):
        for kind in (0, 1):
            rows = base ^ layer_constant(layer, kind, row_bytes)
            parts += [rows[b:b + block_size] for b in range(0, len(prompt), block_size)]
    return digest_rows(parts)


def expected_output(prompt: Sequence[int], num_tokens: int, block_size: int, root_hash: int,
                    num_layers: int, row_bytes: int, vocab: range) -> list[int]:
    """What an emulated engine must answer to `prompt` (greedy, EOS ignored)."""
    digest = expected_digest(prompt, block_size, root_hash, num_layers, row_bytes)
    return output_tokens(digest, 0, num_tokens, vocab)
