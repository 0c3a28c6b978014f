"""The model's tokenizer and chat template, read from its folder (`tokenizer.json`,
`tokenizer_config.json`, `chat_template.jinja`) with `tokenizers` and a sandboxed jinja2
environment. A folder without a chat template gets plain `role: content` lines, with a
warning that says so."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from kvpool.engine.chat_template import compile_template, read_chat_template
from kvpool.engine.model_files import open_tokenizer, read_json_object
from kvpool.serve.byte_decode import ByteDecoder
from kvpool.serve.token_cache import Edges, PieceCache, checked

log = logging.getLogger(__name__)

DEFAULT_CACHE_BYTES = 64 << 20
"""What the pieces of prompts a tokenizer remembers may take (`token_cache.PieceCache`)."""

_FALLBACK_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}")
"""Used when the model folder has no chat template: plain `role: content` lines."""


def _no_cache_reason(tok: Any, added: Iterable[Any]) -> str | None:
    """Why this tokenizer's prompts must be encoded whole, if they must: a piece read alone
    would not read as in the whole text (an added token that takes the spaces around it or
    needs a whole word looks past a piece's edge), a whole text is cut or padded to a length,
    or merges are sampled."""
    if getattr(tok.model, "dropout", None):
        return "BPE dropout samples its merges"
    if tok.truncation or tok.padding:
        return "the tokenizer truncates or pads to a length"
    flagged = [t.content for t in added if t.lstrip or t.rstrip or t.single_word]
    if flagged:
        return f"added tokens with lstrip, rstrip or single_word ({', '.join(flagged[:3])})"
    return None


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class ModelTokenizer:
    """Encode prompts, render chat messages, decode output ids. Raises CheckpointError (a
    ConfigError) when the folder's `tokenizer.json` is missing or does not parse, or its
    tokenizer_config.json or chat template does not."""

    def __init__(self, model_dir: str | Path, cache_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        # One text at a time: the library's thread pool would only add a thread hop to each
        # encode_batch_fast (an explicit setting is kept).
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        folder = Path(model_dir)
        self._tok = open_tokenizer(folder / "tokenizer.json")
        self._bytes = ByteDecoder.of(self._tok)
        """A byte-level tokenizer's ids decoded by a table (serve/byte_decode.py); None else."""
        cfg = read_json_object(folder / "tokenizer_config.json")
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        template, self.chat_template_source = read_chat_template(folder)
        if template is None:
            log.warning("%s has no chat template (chat_template.jinja or tokenizer_config.json); "
                        "chats are rendered as plain 'role: content' lines", folder)
        self.chat_template: str = template or _FALLBACK_TEMPLATE
        self._template = compile_template(self.chat_template,
                                          f"{folder} ({self.chat_template_source})")
        self.cache: PieceCache | None = None
        """Prompts' pieces between special tokens remembered (serve/token_cache.py); None
        when off, or when this tokenizer's pieces do not read alone as in a whole text."""
        self._edges: Edges | None = None
        if cache_bytes > 0:
            self.cache, self._edges = self._piece_cache(cache_bytes)

    def _piece_cache(self, budget: int) -> tuple[PieceCache | None, Edges | None]:
        tok = self._tok
        added = tok.get_added_tokens_decoder()
        why = _no_cache_reason(tok, added.values())
        if why is not None:
            log.info("prompts are encoded whole, without a cache: %s", why)
            return None, None
        # the added tokens the library cuts a text at before its normalizer reads it (special
        # or not, leftmost and longest first, as the cache's split)
        specials = {t.content: i for i, t in added.items() if not t.normalized}
        cache = PieceCache(self._encode_many, specials, budget)
        exact, edges = checked(cache, self._whole, list(specials))
        if not exact:
            log.info("this tokenizer reads pieces between special tokens differently alone; "
                     "prompts are encoded whole, without a cache")
            return None, None
        return cache, edges

    def _whole(self, text: str, add_special_tokens: bool) -> list[int]:
        ids: list[int] = self._tok.encode_batch_fast(
            [text], add_special_tokens=add_special_tokens)[0].ids
        return ids

    def _encode_many(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch_fast(texts, add_special_tokens=False)]

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size())

    @property
    def byte_pieces(self) -> Mapping[int, bytes] | None:
        """A byte-level tokenizer's bytes of each id (`ByteDecoder.pieces`); None for another."""
        return None if self._bytes is None else self._bytes.pieces

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The ids of `text`: its pieces between special tokens from the cache where they
        were seen before, the rest encoded without the offsets `Tokenizer.encode` also
        computes (a quarter of its time for a short prompt)."""
        cache = self.cache
        if cache is not None:
            if not add_special_tokens:
                return cache.ids(text)
            edges = self._edges
            if edges is not None:
                return [*edges[0], *cache.ids(text), *edges[1]] if edges[0] or edges[1] \
                    else cache.ids(text)
        return self._whole(text, add_special_tokens)

    def decode(self, token_ids: Sequence[int]) -> str:
        if self._bytes is not None:
            try:
                return self._bytes(token_ids)
            except KeyError:  # an id the table lacks: the library skips or refuses it
                pass
        return str(self._tok.decode(list(token_ids), skip_special_tokens=True))

    def render_chat(self, messages: Sequence[dict[str, Any]]) -> str:
        """The prompt text for `messages` with the generation prompt appended."""
        return str(self._template.render(messages=list(messages), add_generation_prompt=True,
                                         bos_token=self.bos_token or "",
                                         eos_token=self.eos_token or ""))

    def encode_chat(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        # The template writes its own special tokens (BOS), as transformers' apply_chat_template.
        return self.encode(self.render_chat(messages), add_special_tokens=False)

