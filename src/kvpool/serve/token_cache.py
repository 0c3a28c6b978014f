"""Prompts tokenized piece by piece, the pieces' ids remembered (sans-I/O: the tokenizer's
batch encode is injected).

A tokenizer of the `tokenizers` library cuts a text at its added tokens before anything else
reads it (normalizers and pre-tokenizers run on each piece between them apart), so a text's
ids are its pieces' ids, with the special tokens' ids between them. A chat's prompt is its
messages between the template's special tokens: the turns a conversation sent before, its
system prompt, a tool list, come again in its next request and are looked up here instead of
encoded again (the new message alone is). A text without a special token (a completion's
prompt, most often) is encoded whole and not kept: it comes again whole seldom, and keeping
every one cost each a lookup and an entry for nothing. What is looked up and what is encoded are the same
ids; `ModelTokenizer` checks that on probes before it uses a cache, and keeps none for a
tokenizer whose pieces read differently alone (a Metaspace pre-tokenizer that marks only the
first piece, BPE dropout).

    PieceCache(encode_many, specials, budget_bytes)
        ids(text)           the ids of `text`, the post-processor's tokens (BOS) not added
        hit_tokens, miss_tokens, evicted, size_bytes, entries
"""

from __future__ import annotations

import re
import sys
import threading
from array import array
from collections.abc import Callable, Mapping

from kvpool.sized_lru import SizedLru

EncodeMany = Callable[[list[str]], list[list[int]]]
"""Each text's ids, without the post-processor's tokens (one call for every missed piece)."""

ENTRY_BYTES = 150
"""What an entry costs beyond its text and ids (the dict slot and the array object)."""


class PieceCache:
    def __init__(self, encode_many: EncodeMany, specials: Mapping[str, int],
                 budget_bytes: int) -> None:
        self._encode_many = encode_many
        self._specials = dict(specials)
        names = sorted(self._specials, key=len, reverse=True)  # the longest of a common start
        self._split: Callable[[str], list[str]] = \
            re.compile("(" + "|".join(map(re.escape, names)) + ")").split if names \
            else (lambda text: [text])
        self._pieces: SizedLru[str, array[int]] = SizedLru(budget_bytes, _cost)
        """A piece over 1/8 of the budget is encoded every time, not kept."""
        self._lock = threading.Lock()
        self.hit_tokens = 0
        self.miss_tokens = 0

    @property
    def entries(self) -> int:
        return len(self._pieces)

    @property
    def size_bytes(self) -> int:
        return self._pieces.size_bytes

    @property
    def evicted(self) -> int:
        return self._pieces.evicted

    def ids(self, text: str) -> list[int]:
        parts = self._split(text)  # pieces at even places, the specials between them
        if len(parts) == 1:  # no special token in it: a completion's prompt, encoded whole
            return self._encode_many([text])[0] if text else []
        found: list[array[int] | None] = [None] * len(parts)
        missed: dict[str, list[int]] = {}
        with self._lock:
            for i in range(0, len(parts), 2):
                piece = parts[i]
                if not piece:
                    continue
                held = self._pieces.get(piece)
                if held is None:
                    missed.setdefault(piece, []).append(i)
                else:
                    found[i] = held
                    self.hit_tokens += len(held)
        if missed:
            self._encode_missed(missed, found)
        out: list[int] = []
        specials = self._specials
        for i, part in enumerate(parts):
            if i % 2:
                out.append(specials[part])
            else:
                ids = found[i]
                if ids is not None:
                    out.extend(ids)
        return out

    def _encode_missed(self, missed: dict[str, list[int]],
                       found: list[array[int] | None]) -> None:
        pieces = list(missed)
        encoded = [array("I", ids) for ids in self._encode_many(pieces)]
        with self._lock:
            for piece, ids in zip(pieces, encoded, strict=True):
                for i in missed[piece]:
                    found[i] = ids
                self.miss_tokens += len(ids) * len(missed[piece])
                self._pieces.put(piece, ids)

    def clear(self) -> None:
        with self._lock:
            self._pieces.clear()
            self.hit_tokens = self.miss_tokens = 0


def _cost(piece: str, ids: array[int]) -> int:
    """The text as stored (1, 2 or 4 bytes a character), the ids, and the entry."""
    return sys.getsizeof(piece) + ids.itemsize * len(ids) + ENTRY_BYTES


Whole = Callable[[str, bool], list[int]]
"""The library's encode of a whole text (with the post-processor's tokens or not)."""
Edges = tuple[list[int], list[int]]
"""The ids the post-processor puts before and after a text's own (BOS, EOS)."""

_WORDS = ("hello", " world", "\n\n", "  two  spaces ", "é中文🙂", "12345", "it's", "\t", " ")


def probes(specials: list[str]) -> list[str]:
    """Texts on which a cache must give the library's ids: every special token between words,
    spaces and characters of several scripts, at a text's start and end, twice in a row."""
    out = ["", "plain text", "".join(_WORDS)]
    for n, s in enumerate(specials[:32]):
        w, v = _WORDS[n % len(_WORDS)], _WORDS[(n + 3) % len(_WORDS)]
        out += [f"a{s}b", f" {s} ", f"{s}{w}", f"{w}{s}", f"{s}{s}", f"{w}{s}{v}{s}{w}",
                f"{s}user\n{v}{s}\n{s}assistant\n"]
    return out


def checked(cache: PieceCache, whole: Whole, specials: list[str]) -> tuple[bool, Edges | None]:
    """Whether `cache` gives the library's ids on every probe, and the post-processor's
    edges where wrapping its ids in them gives the library's ids with special tokens too
    (None: texts with the post-processor's tokens are encoded whole). The cache is left
    empty."""
    edges = _edges(whole)
    try:
        for text in probes(specials):
            ids = cache.ids(text)
            if ids != whole(text, False):
                return False, None
            if edges is not None and [*edges[0], *ids, *edges[1]] != whole(text, True):
                edges = None
    finally:
        cache.clear()
    return True, edges


def _edges(whole: Whole) -> Edges | None:
    bare, full = whole("a", False), whole("a", True)
    for k in range(len(full) - len(bare) + 1):
        if full[k:k + len(bare)] == bare:
            return full[:k], full[k + len(bare):]
    return None
