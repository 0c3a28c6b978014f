"""Byte-level tokenizers' ids decoded by a table (serve/byte_decode.py) against the tokenizers
library itself: every id, seeded random runs of ids (partial and invalid UTF-8 included),
special and plain added tokens, ids the table lacks; and tokenizers it must leave to the
library."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from kvpool.serve.byte_decode import ByteDecoder
from kvpool.serve.tokenizer import ModelTokenizer
from tests.serve.test_tokenizer import write_model


def _byte_level(folder: Path) -> Any:
    """A trained byte-level BPE with special tokens and plain added tokens (one with a space
    and characters outside the byte alphabet), saved as a model folder's tokenizer."""
    from tokenizers import AddedToken, Tokenizer

    write_model(folder, None)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.add_tokens([AddedToken("<tool call>", special=False), AddedToken("ünïcode ✓")])
    tok.add_special_tokens(["<|im_end|>"])
    tok.save(str(folder / "tokenizer.json"))
    return tok


def test_every_id_and_random_runs_decode_as_the_library_does(tmp_path: Path) -> None:
    lib = _byte_level(tmp_path / "m")
    table = ByteDecoder.of(lib)
    assert table is not None
    tok = ModelTokenizer(tmp_path / "m")
    n = lib.get_vocab_size(with_added_tokens=True)
    rng = random.Random(3)
    for _ in range(5000):
        ids = [rng.randrange(n) for _ in range(rng.randint(1, 10))]
        want = lib.decode(ids, skip_special_tokens=True)
        assert table(ids) == want and tok.decode(ids) == want, ids
    text = "hello <tool call> ünïcode ✓ wörld 🙂<|im_end|>"
    ids = lib.encode(text).ids
    assert tok.decode(ids) == lib.decode(ids, skip_special_tokens=True)
    assert "<tool call>" in tok.decode(ids) and "<|im_end|>" not in tok.decode(ids)


def test_ids_the_table_lacks_go_to_the_library(tmp_path: Path) -> None:
    lib = _byte_level(tmp_path / "m")
    tok = ModelTokenizer(tmp_path / "m")
    n = lib.get_vocab_size(with_added_tokens=True)
    assert tok.decode([5, n + 10, 6]) == lib.decode([5, n + 10, 6], skip_special_tokens=True)
    with pytest.raises(OverflowError):  # never the bytes of id n - 1
        tok.decode([5, -1])


def test_other_decoders_and_disagreeing_ids_keep_the_library(tmp_path: Path) -> None:
    from tokenizers import decoders

    lib = _byte_level(tmp_path / "m")
    lib.decoder = decoders.Metaspace()
    assert ByteDecoder.of(lib) is None
    lib.decoder = decoders.ByteLevel()
    original = lib.decode
    lib_any: Any = lib

    class Disagreeing:  # the library's own answer, but one id reads otherwise
        decoder = lib.decoder

        def __getattr__(self, name: str) -> Any:
            return getattr(lib_any, name)

        def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
            return "?" if ids == [7] else original(ids, skip_special_tokens=skip_special_tokens)

    assert ByteDecoder.of(lib) is not None and ByteDecoder.of(Disagreeing()) is None
