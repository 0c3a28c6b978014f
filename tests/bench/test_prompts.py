"""`kvpool bench prompts`: its rows, each request's ids and hashes checked against the
library's and the chain's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpool.bench import prompts
from kvpool.cli.main import main
from kvpool.serve.launch import ensure_tiny_model
from kvpool.serve.tokenizer import ModelTokenizer


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


@pytest.mark.parametrize(("chain", "looked_up"), [("kvpool", False), ("sha256_cbor", True)])
def test_a_short_run_prints_a_row_per_load(tiny_model: Path, capsys: pytest.CaptureFixture[str],
                                           chain: str, looked_up: bool) -> None:
    assert main(["bench", "prompts", "--model", str(tiny_model), "--conversations", "2",
                 "--turns", "4", "--message-words", "30", "--unique", "20", "--rounds", "1",
                 "--chain", chain, "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    chat, unique = rows
    assert (chat["load"], chat["requests"], unique["load"], unique["requests"]) == \
        ("chat", 8, "unique", 20)
    assert chat["cache"] and chat["cached_share"] > 0.5 and unique["cached_share"] == 0
    assert (chat["blocks_looked_up"] > 0.5) is looked_up and unique["blocks_looked_up"] == 0


def test_a_conversation_grows_a_turn_per_request(tiny_model: Path) -> None:
    tok = ModelTokenizer(tiny_model, cache_bytes=0)
    texts = prompts.chat_texts(tok, 2, 3, 5)
    assert len(texts) == 6
    for a, b in zip(texts, texts[2:], strict=False):  # each conversation's next request
        assert b.startswith(a[:a.rindex("<|im_start|>assistant")])
