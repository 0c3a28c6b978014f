"""Output ids -> text deltas, with stop strings applied (sans-I/O: no tokenizer calls beyond
`decode`, no sockets). The proxy owns stop strings because only it sees text.

Decoding is incremental, as vLLM's detokenizer does it: only the tokens since the last emitted
piece are decoded, together with the piece before them (so a tokenizer that drops a leading
space does so inside that context, not in the new text), which keeps a long output linear:

    ids  ... | prefix | read ... new |     text(new) = decode(prefix..new) - decode(prefix..read)
                                          (empty while it ends in U+FFFD: a partial character)

Two things are held back from the client:

    emitted | held                      held = an unfinished UTF-8 sequence (above)
    --------+-----                             or the longest tail that begins a stop string
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

_PARTIAL = "\ufffd"
TRIM_CHARS = 1024
"""Emitted characters a stream's text keeps before it drops those no call reads again."""


@dataclass(frozen=True, slots=True)
class TextDelta:
    text: str
    """New text the client may see now."""
    stopped: bool
    """A stop string matched; `text` ends right before it and the request must end."""


class TextStream:
    def __init__(self, decode: Callable[[Sequence[int]], str], stop: Sequence[str] = (),
                 pieces: Mapping[int, bytes] | None = None) -> None:
        self._decode = decode
        self._pieces = pieces
        """A byte-level tokenizer's bytes of each id (`ModelTokenizer.byte_pieces`): the text
        after the last piece is then its tokens' bytes read as UTF-8 (no context needed:
        the decoder was between characters there), one short decode a token instead of two
        of the window. None, or an id it lacks: every decode through `decode`."""
        self._parts: list[bytes] = []
        """With `pieces`: the bytes of each token of `_ids` (those after the last piece)."""
        self._stop = [s for s in stop if s]
        self._longest = max((len(s) for s in self._stop), default=0)
        self._starts = {s[:n] for s in self._stop for n in range(1, len(s) + 1)}
        """Every beginning of a stop string (`_held`)."""
        self._ids: list[int] = []
        """The output's ids as decoded: without the tokens of pieces that decoded to nothing
        (skipped special tokens, `_advance`)."""
        self._count = 0
        """Output tokens pushed (counted until a stop)."""
        self._prefix = self._read = 0
        """Offsets in `_ids`: `_prefix.._read` decoded to the context of the next piece."""
        self._full = ""
        """The output's text up to `_read` (complete characters only), less what lies before
        both what was emitted and where a stop string may still begin (`_trim`): a long
        output's text is not copied again with every piece."""
        self._emitted = 0
        """Characters of `_full` emitted."""
        self._dropped = 0
        """Characters dropped from the front of `_full` (`_trim`)."""
        self._texts: list[str] = []
        """Everything emitted so far, in pieces (`text` joins them)."""
        self.stopped = False

    @property
    def num_tokens(self) -> int:
        return self._count

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        texts = self._texts
        if len(texts) > 1:
            texts[:] = ["".join(texts)]
        return texts[0] if texts else ""

    def push(self, token_id: int) -> TextDelta:
        """Add one output token. After a stop (`stopped`), further tokens are ignored."""
        if self.stopped:
            return TextDelta("", True)
        self._count += 1
        self._append((token_id,))
        piece = self._pending()
        partial = piece.endswith(_PARTIAL)
        if not partial:
            self._advance(piece)
        full = self._full
        if not self._stop:
            return self._emit(full, len(full))
        hit = self._find_stop(full)
        if hit is None and partial:  # its whole characters, before the one still to come
            seen = full + piece.rstrip(_PARTIAL)
            hit = self._find_stop(seen)
            full = seen if hit is not None else full
        if hit is not None:
            self.stopped = True
            return self._emit(full, hit)
        return self._emit_unheld(full)

    def push_many(self, token_ids: Sequence[int]) -> TextDelta:
        """Add a chunk of output tokens: the text they add, as `push` of each in turn would
        give it (the same characters, in one delta). Without stop strings the chunk is decoded
        once, unless it ends inside a character (then, and with stop strings, token by token:
        a stop string ends the request at the token that completes it)."""
        if len(token_ids) == 1:
            return self.push(token_ids[0])
        if not self.stopped and self.cannot_stop(token_ids):
            return self._push_whole(token_ids)
        texts = []
        for tok in token_ids:
            delta = self.push(tok)
            texts.append(delta.text)
            if delta.stopped:
                break
        return TextDelta("".join(texts), self.stopped)

    def _push_whole(self, token_ids: Sequence[int]) -> TextDelta:
        """`push_many` of a chunk in which no stop string can end: the text up to the chunk's
        last token after which it decodes to whole characters (a decode for the chunk, and one
        more for each token of an unfinished character at its end, instead of two per token);
        the tokens after it wait, as `push` leaves them, and so does the tail that may begin a
        stop string."""
        self._count += len(token_ids)
        self._append(token_ids)
        for rest in range(len(token_ids)):  # the chunk's last `rest` tokens wait
            piece = self._pending(rest)
            if not piece.endswith(_PARTIAL):
                self._advance(piece, rest)
                break
        full = self._full
        return self._emit_unheld(full) if self._stop else self._emit(full, len(full))

    def cannot_stop(self, token_ids: Sequence[int]) -> bool:
        """Whether no stop string can end in this chunk (`push_many` of it never stops): there
        is none, or `_stop_cannot_end` says so."""
        return not self._stop or self._stop_cannot_end(token_ids)

    def _stop_cannot_end(self, token_ids: Sequence[int]) -> bool:
        """Whether no stop string can end inside this chunk, so that it can go whole: with a
        byte-level tokenizer, none is in the text it may make after what was emitted (its
        tokens' bytes, with those still waiting, read as UTF-8: more text than the chunk can
        make, never less, so a stop string it ends is always seen; one seen falls back to a
        token at a time, which finds the token that ends it)."""
        pieces = self._pieces
        if pieces is None:
            return False
        try:
            new = b"".join([*self._parts, *(pieces[i] for i in token_ids)])
        except KeyError:
            return False
        text = self._full[self._search_from:] + new.decode("utf-8", "replace")
        return not any(s in text for s in self._stop)

    def flush(self) -> str:
        """The held-back tail, once the output has ended, up to a stop string in it, if any
        (then `stopped`: one in a character the output ended inside of)."""
        if self.stopped:
            return ""
        full = self._full + self._pending()
        hit = self._find_stop(full) if self._stop else None
        if hit is not None:
            self.stopped = True
            return self._emit(full, hit).text
        return self._emit(full, len(full)).text

    def _append(self, token_ids: Sequence[int]) -> None:
        self._ids += token_ids
        if self._pieces is not None:
            try:
                self._parts += [self._pieces[i] for i in token_ids]
            except KeyError:  # an id outside the table: `decode` from here on (the ids
                self._pieces = None  # after the last piece need no context to decode)
                self._parts = []

    def _advance(self, piece: str, keep: int = 0) -> None:
        """`piece` (whole characters) is the text of the tokens after `_read` but the last
        `keep`: the next piece's context is those tokens, and the `keep` wait after it. An
        empty piece leaves the context as it was: one that decodes to nothing would let a
        decoder that strips its text's first space (SentencePiece's) strip the next piece's
        space, which decoding the whole output keeps. After some text its tokens (skipped
        special tokens) are dropped, as decoding the whole output drops them; before any,
        they are kept (the strip at the start depends on them), so the next piece is decoded
        from the first token."""
        ids = self._ids
        end = len(ids) - keep
        if self._pieces is not None:  # bytes need no context: only the waiting stay
            self._full += piece
            del ids[:end], self._parts[:end]
            return
        held = ids[end:]
        del ids[end:]
        if piece:
            self._full += piece
            self._prefix, self._read = self._read, end
        elif self._full or self._dropped:
            del ids[self._read:]
        else:
            self._read = end
        ids += held

    def _pending(self, less: int = 0) -> str:
        """Text of the tokens after `_read` but the last `less`, decoded in the context of
        `_prefix.._read`."""
        if self._pieces is not None:
            parts = self._parts
            return b"".join(parts[:len(parts) - less] if less else parts).decode("utf-8",
                                                                                 "replace")
        ids = self._ids
        context = self._decode(ids[self._prefix:self._read]) if self._read > self._prefix else ""
        return self._decode(ids[self._prefix:len(ids) - less])[len(context):]

    def _emit(self, full: str, end: int) -> TextDelta:
        piece = full[self._emitted:end]
        self._emitted = max(self._emitted, end)
        if piece:
            self._texts.append(piece)
            if self._emitted > TRIM_CHARS:
                self._trim()
        return TextDelta(piece, self.stopped)

    def _trim(self) -> None:
        """Drop the text no call reads again: before what was emitted and before where a stop
        string may still begin (offsets into `_full` move with it)."""
        cut = min(self._emitted, self._search_from)
        self._full = self._full[cut:]
        self._emitted -= cut
        self._dropped += cut

    def _emit_unheld(self, full: str) -> TextDelta:
        """`full` emitted but for its tail that may begin a stop string."""
        return self._emit(full, max(len(full) - self._held(full), self._emitted))

    @property
    def _search_from(self) -> int:
        """Where a stop string completed by new text may begin: none is in what was emitted."""
        return max(0, self._emitted - self._longest + 1)

    def _find_stop(self, full: str) -> int | None:
        start = self._search_from
        hits = [i for i in (full.find(s, start) for s in self._stop) if i >= 0]
        return min(hits) if hits else None

    def _held(self, full: str) -> int:
        """The length of the longest tail of `full` that begins a stop string."""
        starts = self._starts
        for n in range(min(len(full), self._longest), 0, -1):
            if full[-n:] in starts:
                return n
        return 0
