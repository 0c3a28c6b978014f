"""TextStream: stop strings and unfinished UTF-8 are held back, never shown then taken back."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

from kvpool.serve.text import TextStream
from kvpool.serve.tokenizer import ModelTokenizer

PIECES = {0: "Hel", 1: "lo", 2: " wor", 3: "ld", 4: "!", 5: "\ufffd", 6: "é", 7: "EN", 8: "D"}


def decode(ids: Sequence[int]) -> str:
    text = "".join(PIECES[i] for i in ids)
    return text.replace("\ufffdé", "é")  # 5 then 6: a two-token character


def feed(stream: TextStream, ids: list[int]) -> list[str]:
    return [stream.push(i).text for i in ids]


def test_no_stop_emits_each_piece_at_once() -> None:
    s = TextStream(decode)
    assert feed(s, [0, 1, 2, 3]) == ["Hel", "lo", " wor", "ld"]
    assert s.flush() == "" and s.text == "Hello world" and s.num_tokens == 4


def test_stop_string_across_tokens_is_cut_and_never_shown() -> None:
    s = TextStream(decode, stop=["o wo"])
    assert feed(s, [0, 1]) == ["Hel", "l"]  # "o" might begin the stop string
    delta = s.push(2)
    assert (delta.text, delta.stopped) == ("", True)
    assert s.text == "Hell" and s.stopped
    assert s.push(3).text == "" and s.flush() == ""


def test_held_prefix_is_released_when_the_stop_does_not_follow() -> None:
    s = TextStream(decode, stop=["ldX"])
    assert feed(s, [0, 1, 2, 3]) == ["He", "llo", " wor", ""]  # "l", "ld" may begin "ldX"
    assert s.push(4).text == "ld!"
    s2 = TextStream(decode, stop=["ldX"])
    feed(s2, [0, 1, 2, 3])
    assert s2.flush() == "ld" and s2.text == "Hello world"


def test_earliest_of_several_stops_wins() -> None:
    s = TextStream(decode, stop=["world", "lo"])
    assert feed(s, [0, 1]) == ["He", "l"]
    assert s.stopped and s.text == "Hel"


def test_unfinished_utf8_waits_for_its_next_token() -> None:
    s = TextStream(decode)
    assert feed(s, [0, 5, 6]) == ["Hel", "", "é"]
    assert s.text == "Helé"


def test_stop_at_the_very_start_and_empty_stops_ignored() -> None:
    s = TextStream(decode, stop=["", "EN"])
    assert feed(s, [7]) == [""] and s.stopped and s.text == ""


def test_incremental_text_equals_decoding_the_whole_output(tiny_model: object) -> None:
    """Against the real byte-level tokenizer: pieces joined == one decode of all ids."""
    tok = ModelTokenizer(str(tiny_model))
    rng = random.Random(5)
    for _ in range(20):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 120))]
        s = TextStream(tok.decode)
        text = "".join(s.push(i).text for i in ids) + s.flush()
        assert text == tok.decode(ids) == s.text


def test_a_chunk_gives_the_text_its_tokens_give_one_by_one() -> None:
    """push_many == push of each token in turn, joined: the same text, the same stop, the same
    count, for random chunkings (a two-token character, a stop string across chunks)."""
    rng = random.Random(3)
    for _ in range(400):
        ids = [rng.randrange(len(PIECES)) for _ in range(rng.randint(1, 14))]
        stop = rng.choice([(), ("o w",), ("ld!", "é"), ("EN",)])
        _chunks_as_singles(TextStream(decode, stop), TextStream(decode, stop), ids, rng, 4)


def _chunks_as_singles(one: TextStream, many: TextStream, ids: list[int], rng: random.Random,
                       most: int) -> None:
    """`many` fed `ids` in random chunks of up to `most` equals `one` fed them one by one:
    the text, the stop, the count and the tail."""
    singles = feed(one, ids)
    deltas, at = [], 0
    while at < len(ids) and not many.stopped:
        n = rng.randint(1, most)
        deltas.append(many.push_many(ids[at:at + n]).text)
        at += n
    assert "".join(deltas) == "".join(singles[:one.num_tokens]), ids
    assert (many.stopped, many.num_tokens) == (one.stopped, one.num_tokens), ids
    assert many.flush() == one.flush() and many.text == one.text, ids


BYTES = {0: b"Hel", 1: b"lo", 2: b" wor", 3: b"ld", 4: b"!", 5: b"\xc3", 6: b"\xa9", 7: b"EN",
         8: b"D", 9: b""}
"""A byte-level table: 5 then 6 is "é", 9 a skipped special token."""


def _byte_decode(ids: Sequence[int]) -> str:
    return b"".join(BYTES[i] for i in ids).decode("utf-8", "replace")


def test_a_byte_level_chunk_with_stop_strings_gives_what_its_tokens_give_one_by_one() -> None:
    """With stop strings and a byte table, a chunk in which no stop string can end goes
    whole (one decode): push_many still equals a push of each token in turn, joined, for
    random chunkings, stop strings that end inside a chunk, across chunks, inside a
    two-byte character ("é") and never."""
    rng = random.Random(5)
    stops = [("o w",), ("ld!", "é"), ("EN",), ("lo wor", "DD"), ("\u00e9l",), ("zz",)]
    for _ in range(3000):
        ids = [rng.randrange(len(BYTES)) for _ in range(rng.randint(1, 24))]
        stop = rng.choice(stops)
        _chunks_as_singles(TextStream(_byte_decode, stop, BYTES),
                           TextStream(_byte_decode, stop, BYTES), ids, rng, 7)


WHOLE_THEN_PART = {0: b"Hi", 1: b" \xc3", 2: b"\xa9!", 3: b"\xd0\xbe\xd0", 4: b"\xb1"}
"""A byte table whose tokens end with a whole character and the first byte of the next (1:
" " and half of "é"; 3: "о" and half of "б")."""


def _whole_then_part(ids: Sequence[int]) -> str:
    return b"".join(WHOLE_THEN_PART[i] for i in ids).decode("utf-8", "replace")


def test_a_stop_in_the_whole_characters_before_a_partial_one_ends_at_its_token() -> None:
    """A token that ends with a whole character and half of the next: a stop string in the
    whole ones ends the text at that token (not at the one that finishes the character), on
    both decode paths."""
    for pieces in (WHOLE_THEN_PART, None):
        s = TextStream(_whole_then_part, [" "], pieces)
        assert feed(s, [0, 1]) == ["Hi", ""]
        assert s.stopped and s.num_tokens == 2 and s.text == "Hi"
        s = TextStream(_whole_then_part, ["о"], pieces)  # Cyrillic o
        assert feed(s, [0, 3]) == ["Hi", ""] and s.stopped and s.num_tokens == 2


def test_a_stop_in_the_tail_the_output_ended_inside_of_is_applied_at_flush() -> None:
    """The output ends inside a character: flush emits what it held up to a stop string in
    it, and says it stopped (the client never sees the stop string); one that holds none
    comes whole, with U+FFFD for the unfinished character."""
    for pieces in (WHOLE_THEN_PART, None):
        s = TextStream(_whole_then_part, ["\ufffd"], pieces)
        assert feed(s, [0, 1]) == ["Hi", ""]
        assert s.flush() == " " and s.stopped and s.text == "Hi "
        s = TextStream(_whole_then_part, ["zz"], pieces)
        assert feed(s, [0, 1]) == ["Hi", ""]
        assert s.flush() == " \ufffd" and not s.stopped


def test_a_piece_after_tokens_that_decode_to_nothing_keeps_its_space(tmp_path: Path) -> None:
    """A SentencePiece-style decoder (metaspace, byte fallback, strip of the first space), its
    byte tokens special here so that many pieces decode to nothing: the streamed text is the
    whole output's. A piece decoded after a context that decodes to nothing lost its leading
    space to the strip before the context reached back past such tokens: 10 of these 201
    outputs, "The quick brown fox 🙂 jumps" among them (its emoji bytes skipped, "fox  jumps"
    streamed as "fox jumps")."""
    tok = _sentencepiece_style(tmp_path)
    rng = random.Random(2)
    outputs = [tok.encode("The quick brown fox \U0001f642 jumps", add_special_tokens=False)]
    outputs += [[rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 40))]
                for _ in range(200)]
    for ids in outputs:
        s = TextStream(tok.decode)
        assert "".join(feed(s, ids)) + s.flush() == tok.decode(ids), ids


def _sentencepiece_style(tmp_path: Path) -> ModelTokenizer:
    """A SentencePiece-style tokenizer (metaspace, byte fallback, strip of the first space)
    whose byte tokens are special, so that many pieces decode to nothing."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    raw = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    raw.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    raw.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    raw.train_from_iterator(["The quick brown fox jumps over the lazy dog, é 你好"] * 20,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=[
                                "<unk>", "<s>", *(f"<0x{i:02X}>" for i in range(256))]))
    raw.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text("{}")
    return ModelTokenizer(tmp_path)


def test_chunks_of_real_tokenizers_give_each_chunk_its_tokens_text(tiny_model: object,
                                                                   tmp_path: Path) -> None:
    """push_many of random chunks of random ids (unfinished characters at many chunks' ends,
    skipped special tokens inside them, a stop string taken from the text or none), with
    decoding through the tokenizer and, for the byte-level one, from its bytes per id: each
    chunk's delta is the text its tokens give pushed one by one through the tokenizer, for
    a byte-level tokenizer and a SentencePiece-style one."""
    rng = random.Random(11)
    for tok in (ModelTokenizer(str(tiny_model)), _sentencepiece_style(tmp_path)):
        for _ in range(150):
            ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 60))]
            whole = tok.decode(ids)
            at = rng.randrange(max(1, len(whole) - 3))
            stop = rng.choice([(), (whole[at:at + 3],)])
            one = TextStream(tok.decode, stop)
            streams = [TextStream(tok.decode, stop), TextStream(tok.decode, stop, tok.byte_pieces)]
            at = 0
            while at < len(ids) and not one.stopped:
                chunk = ids[at:at + rng.randint(1, 6)]
                at += len(chunk)
                want = "".join(feed(one, chunk))
                assert all(s.push_many(chunk).text == want for s in streams), (ids, stop)
            tail = one.flush()
            for s in streams:
                assert (s.flush(), s.text, s.stopped, s.num_tokens) == \
                    (tail, one.text, one.stopped, one.num_tokens)
            assert stop or one.text == whole


def test_the_byte_path_decodes_an_id_outside_its_table_through_the_tokenizer(
        tiny_model: object) -> None:
    """An id the byte table lacks (one past the vocabulary) turns a stream that decodes from
    bytes to decoding through the tokenizer, which skips it: the text is the same."""
    tok = ModelTokenizer(str(tiny_model))
    assert tok.byte_pieces is not None
    ids = tok.encode("héllo wörld", add_special_tokens=False)
    odd = [*ids[:3], tok.vocab_size + 7, *ids[3:]]
    for pieces in (None, tok.byte_pieces):
        s = TextStream(tok.decode, (), pieces)
        assert "".join(feed(s, odd)) + s.flush() == tok.decode(ids) == s.text


def test_a_long_run_of_skipped_tokens_costs_a_short_decode_each(tiny_model: object) -> None:
    """Skipped special tokens after some text (a model that repeats its end token under
    ignore_eos) are dropped from the decoded window, so each costs a decode of a few ids, not
    of the whole run; before any text they are kept (the whole output decodes from them)."""
    tok = ModelTokenizer(str(tiny_model))
    special = next(i for i in range(tok.vocab_size) if tok.decode([i]) == "")
    for ids in (tok.encode("Hello there") + [special] * 2000 + tok.encode(" world"),
                [special] * 50 + tok.encode(" world")):
        decoded = 0

        def counting(part: Sequence[int]) -> str:
            nonlocal decoded
            decoded += len(part)
            return tok.decode(part)
        s = TextStream(counting)
        assert "".join(feed(s, ids)) + s.flush() == tok.decode(ids)
        assert s.num_tokens == len(ids)
        assert decoded < 10 * len(ids) + 50 * 50, decoded


def test_a_long_outputs_text_is_not_kept_whole_in_the_window(tiny_model: object) -> None:
    """40,000 tokens, one at a time and in chunks, with and without a stop string that
    comes at the very end: the same text as decoding the whole output, and the window the
    stream keeps (`_full`) stays short, so a token's cost does not grow with the output."""
    tok = ModelTokenizer(str(tiny_model))
    ids = tok.encode("héllo wörld, the cache block pool 日本語 " * 2000, add_special_tokens=False)
    want = tok.decode(ids)
    for stop in ([], ["zzzq"]):
        for size in (1, 7):
            s = TextStream(tok.decode, stop, tok.byte_pieces)
            longest = 0
            got = []
            for i in range(0, len(ids), size):
                got.append(s.push_many(ids[i:i + size]).text)
                longest = max(longest, len(s._full))
            got.append(s.flush())
            assert "".join(got) == want == s.text and not s.stopped
            assert longest < 4096, (stop, size, longest)  # of about 100,000 characters
    s = TextStream(tok.decode, ["日本語 héllo"], tok.byte_pieces)
    text = "".join(s.push(i).text for i in ids)
    assert s.stopped and text == want[:want.index("日本語 héllo")] == s.text
