"""Our model against the independent reference: transformers' LlamaForCausalLM and
Qwen2ForCausalLM on the same checkpoint, float32."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvpool.engine.checkpoint import load_model
from tests.engine.helpers import full_logits

transformers = pytest.importorskip("transformers")

PROMPT = [5, 17, 300, 42, 9, 101, 77, 3, 250, 18, 64, 199, 7, 7, 31, 400, 12, 88, 2, 141]


def hf_logits(model_dir: Path, ids: list[int]) -> torch.Tensor:
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2", "tiny_llama3_rope",
                                     "tiny_linear_rope"])
def test_logits_match_transformers(fixture: str, request: pytest.FixtureRequest) -> None:
    model_dir = request.getfixturevalue(fixture)
    ours = full_logits(load_model(model_dir), PROMPT, block_size=8)
    theirs = hf_logits(model_dir, PROMPT)
    assert ours.shape == theirs.shape
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def test_architectures_are_what_they_claim(tiny_llama: Path, tiny_qwen2: Path) -> None:
    assert type(transformers.AutoModelForCausalLM.from_pretrained(tiny_llama)).__name__ == \
        "LlamaForCausalLM"
    qwen = transformers.AutoModelForCausalLM.from_pretrained(tiny_qwen2)
    assert type(qwen).__name__ == "Qwen2ForCausalLM"
    assert json.loads((tiny_qwen2 / "config.json").read_text())["tie_word_embeddings"]
    assert load_model(tiny_qwen2).model.layers[0].self_attn.q_proj.bias is not None


def test_bfloat16_is_close_to_float32(tiny_llama: Path) -> None:
    full = full_logits(load_model(tiny_llama), PROMPT)
    half = full_logits(load_model(tiny_llama, dtype="bfloat16"), PROMPT)
    assert half.dtype == torch.float32
    assert (half - full).abs().max() < 0.1
