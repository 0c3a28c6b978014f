"""Our model against the independent reference: transformers' LlamaForCausalLM and
Qwen2ForCausalLM on the same checkpoint, float32."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kvpool.engine.checkpoint import load_model
from kvpool.engine.model import causal_attention
from tests.engine.helpers import full_logits
from tests.support.require import outside_ci, require_module

transformers = require_module("transformers", "the test extra (scripts/setup.sh)")

PROMPT = [5, 17, 300, 42, 9, 101, 77, 3, 250, 18, 64, 199, 7, 7, 31, 400, 12, 88, 2, 141]
SMALL = [t % 320 for t in PROMPT[:12]]


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


@pytest.mark.skipif(not torch.cuda.is_available(), reason=outside_ci("no CUDA device"))
def test_cuda_matches_cpu(tiny_llama: Path) -> None:
    from kvpool.engine.config import EngineConfig, SamplingParams
    from kvpool.engine.llm_engine import LLMEngine
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    cpu = LLMEngine.from_dir(tiny_llama, EngineConfig(block_size=8)).generate([PROMPT], params)
    gpu = LLMEngine.from_dir(tiny_llama, EngineConfig(block_size=8, device="cuda"))
    assert gpu.generate([PROMPT], params) == cpu


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_checkpoint_written_by_transformers(arch: str, tmp_path: Path) -> None:
    """A folder written by transformers' own save_pretrained (its config.json spelling)."""
    common = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    if arch == "llama":
        config = transformers.LlamaConfig(**common, rope_scaling={
            "rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
        hf = transformers.LlamaForCausalLM(config)
    else:
        config = transformers.Qwen2Config(**common, tie_word_embeddings=True, rope_theta=1e6)
        hf = transformers.Qwen2ForCausalLM(config)
    hf.save_pretrained(tmp_path)
    ours = full_logits(load_model(tmp_path), SMALL, block_size=8)
    with torch.no_grad():
        theirs = hf.eval()(torch.tensor([SMALL])).logits[0]
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(("num_new", "context_len"), [(600, 600), (700, 1500), (1, 37), (257, 257)])
def test_causal_attention_equals_sdpa(num_new: int, context_len: int) -> None:
    """Query blocks, skipped keys and grouped heads change nothing: the last `num_new` of
    `context_len` positions attend as one masked scaled_dot_product_attention call."""
    g = torch.Generator().manual_seed(num_new)
    q = torch.randn(num_new, 6, 16, generator=g)
    k, v = torch.randn(2, context_len, 2, 16, generator=g)
    first = context_len - num_new
    mask = torch.arange(context_len)[None, :] <= torch.arange(first, context_len)[:, None]
    want = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                          attn_mask=mask, enable_gqa=True).transpose(0, 1)
    torch.testing.assert_close(causal_attention(q, k, v), want, atol=1e-5, rtol=1e-5)
