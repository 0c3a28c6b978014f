"""ModelTokenizer: tokenizer.json + the chat template of tokenizer_config.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from jinja2.exceptions import TemplateError

from kvpool.errors import ConfigError
from kvpool.serve.tokenizer import ModelTokenizer

TEMPLATE = ("{{ bos_token }}{% for m in messages %}"
            "{% if m['role'] == 'tool' %}{{ raise_exception('no tools') }}{% endif %}"
            "<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def write_model(folder: Path, template: str | None) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello world", "the quick brown fox"] * 10, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    cfg: dict[str, object] = {"bos_token": {"content": "<s>"}, "eos_token": "</s>"}
    if template is not None:
        cfg["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    return folder


def test_encode_decode_round_trip(tmp_path: Path) -> None:
    t = ModelTokenizer(write_model(tmp_path / "m", TEMPLATE))
    ids = t.encode("hello world")
    assert ids and t.decode(ids) == "hello world"


def test_encode_is_the_librarys_encode(tmp_path: Path) -> None:
    """The ids without offsets (`encode_batch_fast`) are `Tokenizer.encode`'s, with and
    without special tokens."""
    from tokenizers import Tokenizer, processors
    folder = write_model(tmp_path / "m", TEMPLATE)
    lib = Tokenizer.from_file(str(folder / "tokenizer.json"))
    lib.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[
        ("<s>", lib.token_to_id("<s>"))])
    lib.save(str(folder / "tokenizer.json"))
    t = ModelTokenizer(folder)
    for text in ("hello world", "", " the  quick\nbrown fox \u00e9\u6f22", "<s>hello</s>"):
        for special in (True, False):
            assert t.encode(text, special) == lib.encode(text, add_special_tokens=special).ids
    assert t.encode("hello")[0] == lib.token_to_id("<s>") != t.encode("hello", False)[0]


def test_chat_template_renders_with_special_tokens(tmp_path: Path) -> None:
    t = ModelTokenizer(write_model(tmp_path / "m", TEMPLATE))
    msgs = [{"role": "user", "content": "hi"}]
    assert t.render_chat(msgs) == "<s><|user|>hi</s><|assistant|>"
    assert t.encode_chat(msgs)[0] == 1  # <s> written by the template, not added twice
    with pytest.raises(TemplateError, match="no tools"):
        t.render_chat([{"role": "tool", "content": "x"}])


def test_no_template_falls_back_to_role_lines(tmp_path: Path) -> None:
    t = ModelTokenizer(write_model(tmp_path / "m", None))
    assert t.render_chat([{"role": "user", "content": "hi"}]) == "user: hi\nassistant:"


def test_missing_tokenizer_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="tokenizer.json"):
        ModelTokenizer(tmp_path)
