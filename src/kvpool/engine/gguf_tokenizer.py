"""The tokenizer of a GGUF file: its byte-level BPE vocabulary and merges
(`tokenizer.ggml.model` = "gpt2") rebuilt as a `tokenizers.Tokenizer`, tokens of type control
as special tokens; the metadata is checked as untrusted input (lists of strings, merges of two
tokens, BOS/EOS ids inside the vocabulary, a chat template that compiles)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvpool.engine.chat_template import compile_template
from kvpool.errors import CheckpointError

TOKEN_TYPE_CONTROL = 3


def checked_tokenizer(file: Path, meta: dict[str, Any], context_len: int) -> tuple[Any, dict[str, Any]]:
    """The file's tokenizer and its tokenizer_config.json (BOS/EOS tokens, context length,
    chat template, which must compile); CheckpointError naming `file`."""
    try:
        tokenizer = build_tokenizer(meta)
        tok_cfg = {"bos_token": _token(meta, "bos"), "eos_token": _token(meta, "eos"),
                   "model_max_length": context_len,
                   "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False))}
        template = meta.get("tokenizer.chat_template")
        if template is not None and not isinstance(template, str):
            raise CheckpointError("GGUF metadata tokenizer.chat_template is not a string")
        if template:
            compile_template(template, "GGUF metadata tokenizer.chat_template")
            tok_cfg["chat_template"] = template
    except CheckpointError as exc:
        raise CheckpointError(f"{file}: {exc}") from None
    return tokenizer, tok_cfg


PRE_TOKENIZERS = {"smollm": True, "gpt2": False, "default": False}
"""`tokenizer.ggml.pre` -> whether digits are split one by one before the byte-level regex
(llama.cpp's pre-tokenizer types for byte-level BPE vocabularies)."""


def build_tokenizer(meta: dict[str, Any]) -> Any:
    """A `tokenizers.Tokenizer` from the file's byte-level BPE vocabulary and merges."""
    kind, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre", "default")
    if kind != "gpt2" or not isinstance(pre, str) or pre not in PRE_TOKENIZERS:
        raise CheckpointError(f"GGUF tokenizer {kind!r} / pre-tokenizer {pre!r} is not supported "
                              f"(byte-level BPE with {', '.join(PRE_TOKENIZERS)})")
    tokens = _strings(meta, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in _strings(meta, "tokenizer.ggml.merges")]
    if any(len(m) != 2 for m in merges):
        raise CheckpointError("GGUF metadata tokenizer.ggml.merges holds an entry without a "
                              "space (each merge is two tokens)")
    try:
        return _byte_level_bpe(tokens, merges, PRE_TOKENIZERS[pre],
                               meta.get("tokenizer.ggml.token_type") or [])
    except Exception as exc:  # the tokenizers library raises bare Exception
        raise CheckpointError(f"GGUF tokenizer cannot be built ({exc})") from None


def _strings(meta: dict[str, Any], key: str) -> list[str]:
    value = meta.get(key)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise CheckpointError(f"GGUF metadata {key} must be a list of strings")
    return value


def _byte_level_bpe(tokens: list[str], merges: list[Any], split_digits: bool,
                    types: Any) -> Any:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                  byte_level])
                         if split_digits else byte_level)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, kind_ in zip(tokens, types, strict=False)
                            if kind_ == TOKEN_TYPE_CONTROL])
    return tok


def _token(meta: dict[str, Any], key: str) -> str | None:
    idx, tokens = meta.get(f"tokenizer.ggml.{key}_token_id"), meta["tokenizer.ggml.tokens"]
    if idx is None:
        return None
    if isinstance(idx, bool) or not isinstance(idx, int) or not 0 <= idx < len(tokens):
        raise CheckpointError(f"GGUF metadata tokenizer.ggml.{key}_token_id is {idx!r}, not a "
                              f"token of the {len(tokens)} in the vocabulary")
    return str(tokens[idx])
