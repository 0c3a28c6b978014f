"""Prompts tokenized piece by piece with the pieces remembered (serve/token_cache.py): the ids
are the `tokenizers` library's own for the whole text (its `Tokenizer.encode`, the reference),
on chats and random texts with special tokens anywhere, with and without the post-processor's
tokens, from several threads at once; a tokenizer whose pieces read differently alone gets no
cache; the cache keeps to its budget, least recently used first."""

from __future__ import annotations

import json
import random
import sys
import threading
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from kvpool.serve.token_cache import ENTRY_BYTES, PieceCache, checked
from kvpool.serve.tokenizer import ModelTokenizer

SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
WORDS = ["the", " pool", " keeps", "\n", "\n\n", "  ", "été", " 中文", "🙂", "12345", " it's",
         "\t", "user", "assistant", ".", "<|im", "_start|>", "<", "|>"]


def _random_text(rng: random.Random, specials: list[str], n: int = 40) -> str:
    return "".join(rng.choice(specials) if rng.random() < 0.15 else rng.choice(WORDS)
                   for _ in range(n))


def _reference(folder: Path) -> Tokenizer:
    return Tokenizer.from_file(str(folder / "tokenizer.json"))


def _specials(tok: Tokenizer) -> list[str]:
    return [t.content for t in tok.get_added_tokens_decoder().values() if t.special]


def _assert_exact(ours: ModelTokenizer, ref: Tokenizer, texts: list[str]) -> None:
    for text in texts:
        for add in (False, True):
            assert ours.encode(text, add) == ref.encode(text, add_special_tokens=add).ids, \
                (text, add)


def test_the_tiny_models_prompts_are_the_librarys_ids_whether_remembered_or_not(
        tiny_model: Path) -> None:
    ours, ref = ModelTokenizer(tiny_model), _reference(tiny_model)
    assert ours.cache is not None
    rng = random.Random(7)
    texts = [_random_text(rng, _specials(ref)) for _ in range(300)]
    _assert_exact(ours, ref, texts)  # first sight: encoded
    _assert_exact(ours, ref, texts)  # again: looked up
    assert ours.cache.hit_tokens > 0 and ours.cache.miss_tokens > 0


def test_a_conversation_is_encoded_once_per_new_turn(tiny_model: Path) -> None:
    ours, ref = ModelTokenizer(tiny_model), _reference(tiny_model)
    cache = ours.cache
    assert cache is not None
    messages = [{"role": "system", "content": "You keep the pool. " * 30}]
    encoded: list[int] = []
    for turn in range(12):
        messages.append({"role": "user", "content": f"Question {turn}: " + "why? " * 40})
        before = cache.miss_tokens
        ids = ours.encode_chat(messages)
        assert ids == ref.encode(ours.render_chat(messages), add_special_tokens=False).ids
        encoded.append(cache.miss_tokens - before)
        messages.append({"role": "assistant", "content": f"Answer {turn}: " + "so. " * 50})
    # from the second turn on, only the last answer and the new question are encoded (with
    # the template's short pieces around them): as many tokens each turn, however long the
    # conversation grows
    assert max(encoded[2:]) - min(encoded[2:]) <= 4
    assert encoded[-1] < 0.1 * len(ids)


def _trained(folder: Path, scheme: str) -> Path:
    """A small BPE tokenizer with a Metaspace pre-tokenizer (as sentencepiece models
    converted for `tokenizers` have) and chat special tokens."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme)
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme=scheme)
    corpus = ["the pool keeps every block", "a prefix computed once", "été 中文 12345"] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=120, special_tokens=SPECIALS))
    # an added token that is no special token, and that begins before a special one begins:
    # the library takes the leftmost match, the longest first, and so must the cache's cuts
    tok.add_tokens([AddedToken("x<|im", normalized=False)])
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({}))
    (folder / "chat_template.jinja").write_text(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}<|im_start|>assistant\n")
    return folder


@pytest.mark.parametrize(("scheme", "cached"), [("first", False), ("always", True)])
def test_a_tokenizer_whose_pieces_read_differently_alone_gets_no_cache(
        tmp_path: Path, scheme: str, cached: bool) -> None:
    """Metaspace marking only the text's first piece: "<|im_start|>user" gives "u s er"
    in a whole text and "▁user" alone, so such a tokenizer encodes whole; one that marks
    every piece is remembered. Both give the library's ids."""
    folder = _trained(tmp_path / scheme, scheme)
    ours, ref = ModelTokenizer(folder), _reference(folder)
    assert (ours.cache is not None) is cached
    rng = random.Random(3)
    texts = [_random_text(rng, SPECIALS) for _ in range(200)]
    texts += [t.replace("<|im_", "x<|im_", 1) for t in texts]
    added = ref.token_to_id("x<|im")
    assert any(added in ref.encode(t).ids for t in texts)
    _assert_exact(ours, ref, texts)
    _assert_exact(ours, ref, texts)


@pytest.mark.parametrize("flag", ["lstrip", "rstrip", "single_word", "truncation"])
def test_a_tokenizer_that_looks_past_a_pieces_edge_gets_no_cache(tmp_path: Path,
                                                                 flag: str) -> None:
    """An added token that takes the spaces around it or needs a whole word is matched on the
    whole text (at "hiUser", a whole-word "hi" is no match: "U" follows), and a text cut to a
    length is cut whole: such tokenizers encode every prompt whole."""
    folder = _trained(tmp_path / "t", "always")
    tok = _reference(folder)
    if flag == "truncation":
        tok.enable_truncation(64)
    else:
        tok.add_special_tokens([AddedToken("User", normalized=False)])
        tok.add_tokens([AddedToken("hi", normalized=False, **{flag: True})])
    tok.save(str(folder / "tokenizer.json"))
    ours, ref = ModelTokenizer(folder), _reference(folder)
    assert ours.cache is None
    rng = random.Random(5)
    texts = ["hiUser", "say hiUser: ok", " hi User hi", "Userhi  hi"]
    texts += [_random_text(rng, [*SPECIALS, "User", "hi"], 120) for _ in range(50)]
    _assert_exact(ours, ref, texts)


def test_threads_encoding_at_once_get_the_librarys_ids(tiny_model: Path) -> None:
    ours, ref = ModelTokenizer(tiny_model, cache_bytes=64 << 10), _reference(tiny_model)
    rng = random.Random(11)
    texts = [_random_text(rng, _specials(ref), 60) for _ in range(100)]
    want = [ref.encode(t, add_special_tokens=False).ids for t in texts]
    wrong: list[str] = []

    def run(seed: int) -> None:
        order = list(range(len(texts)))
        random.Random(seed).shuffle(order)
        for _ in range(3):
            wrong.extend(texts[i] for i in order if ours.encode(texts[i], False) != want[i])

    threads = [threading.Thread(target=run, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not wrong
    assert ours.cache is not None and ours.cache.size_bytes <= 64 << 10


def _fake_encode(texts: list[str]) -> list[list[int]]:
    """A stand-in for a tokenizer: one id per character."""
    return [[ord(c) for c in t] for t in texts]


def test_the_cache_keeps_to_its_budget_least_recently_used_first() -> None:
    calls: list[list[str]] = []

    def encode(texts: list[str]) -> list[list[int]]:
        calls.append(texts)
        return _fake_encode(texts)

    def ids(text: str) -> list[int]:
        return _fake_encode([text.replace("|", "\0")])[0]

    cache = PieceCache(encode, {"|": 0}, budget_bytes=4000)
    pieces = [f"piece {i:03d} " * 4 for i in range(30)]  # 40 characters, 160 bytes of ids
    cost = sys.getsizeof(pieces[0]) + 4 * 40 + ENTRY_BYTES
    for p in pieces:
        assert cache.ids(f"{p}|") == ids(f"{p}|")
    assert cache.size_bytes <= 4000 and cache.evicted == 30 - cache.entries
    assert cache.entries == 4000 // cost
    calls.clear()
    assert cache.ids(f"|{pieces[-1]}") == ids(f"|{pieces[-1]}") and not calls  # kept
    assert cache.ids(f"{pieces[0]}|") == ids(f"{pieces[0]}|") and calls == [[pieces[0]]]
    # pieces between specials: each missed piece encoded once, in one call, in order
    calls.clear()
    text = f"{pieces[1]}|{pieces[-1]}|{pieces[1]}||x"
    assert cache.ids(text) == ids(text)
    assert calls == [[pieces[1], "x"]]
    # a piece over an eighth of the budget is encoded every time, never kept
    big = "y" * 300
    cache.ids(f"|{big}")
    cache.ids(f"|{big}")
    assert big not in cache._pieces and calls[-2:] == [[big], [big]]
    # a text without a special token is encoded whole, and not kept
    calls.clear()
    assert cache.ids(pieces[5]) == ids(pieces[5]) and cache.ids(pieces[5]) == ids(pieces[5])
    assert calls == [[pieces[5]], [pieces[5]]]


def test_probes_refuse_a_cache_that_is_not_the_whole_texts_ids() -> None:
    def whole(text: str, add: bool) -> list[int]:
        return ([1] if add else []) + [ord(c) + 1 for c in text]  # not the pieces' ids

    exact, edges = checked(PieceCache(_fake_encode, {"<s>": 0}, 1 << 20), whole, ["<s>"])
    assert not exact and edges is None

    cache = PieceCache(_fake_encode, {}, 1 << 20)
    exact, edges = checked(cache, lambda t, add: ([1] if add else []) + _fake_encode([t])[0], [])
    assert exact and edges == ([1], []) and cache.entries == 0


@pytest.mark.slow  # imports the GGUF file's tokenizer (about 10 s)
def test_the_default_models_prompts_are_the_librarys_ids(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """SmolLM2's tokenizer (Digits then ByteLevel, 17 special tokens) keeps a cache, and its
    chats and random texts are the library's ids, cold and warm."""
    pytest.importorskip("gguf")
    from kvpool.serve.models import resolve_model

    monkeypatch.setenv("KVPOOL_MODEL_CACHE", str(tmp_path))
    folder = resolve_model("smollm2")
    ours, ref = ModelTokenizer(folder), _reference(folder)
    assert ours.cache is not None
    rng = random.Random(13)
    texts = [_random_text(rng, _specials(ref), 60) for _ in range(300)]
    messages = [{"role": "system", "content": "You keep the pool."}]
    for turn in range(6):
        messages += [{"role": "user", "content": f"Turn {turn}: what is 12 + {turn}?"}]
        texts.append(ours.render_chat(messages))
        messages += [{"role": "assistant", "content": f"{12 + turn}, é 中文 🙂"}]
    _assert_exact(ours, ref, texts)
    _assert_exact(ours, ref, texts)
    assert ours.cache.hit_tokens > 0
