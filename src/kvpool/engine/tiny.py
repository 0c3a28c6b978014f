"""`kvpool model make-tiny`: a small random checkpoint in exactly the Hugging Face layout
(config.json, model.safetensors, tokenizer.json, tokenizer_config.json), so that both kvpool
and `transformers` load it. The tokenizer is a byte-level BPE trained on text made here from a
fixed word list, so the same seed gives the same folder byte for byte."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from kvpool.engine.config import ModelConfig
from kvpool.engine.model import CausalLM
from kvpool.errors import ConfigError

SPECIALS = ["<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_WORDS = ("the a cache block pool prefill decode token layer model key value store node "
          "request reply fast slow memory transfer engine batch prompt hash chain read write "
          "user assistant system hello world one two three four five six seven eight nine ten "
          "and or not if then when while for with from into over under data serve "
          "what why how is are was be can will should could of to in on at by").split()


@dataclass(frozen=True)
class TinySpec:
    arch: str = "llama"
    """llama or qwen2"""
    num_layers: int = 2
    hidden_size: int = 64
    num_heads: int = 4
    num_kv_heads: int = 2
    vocab_size: int = 512
    intermediate_size: int = 0
    """0: 2 x hidden_size (rounded to a multiple of 8)"""
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    rope_scaling: dict[str, Any] | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.arch not in ("llama", "qwen2"):
            raise ConfigError(f"arch must be llama or qwen2, got {self.arch!r}")
        if self.vocab_size < 300:
            raise ConfigError(f"vocab_size must be >= 300 (256 bytes + specials), got {self.vocab_size}")


def hf_config(spec: TinySpec) -> dict[str, Any]:
    arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[spec.arch]
    config: dict[str, Any] = {
        "architectures": [arch], "model_type": spec.arch,
        "vocab_size": spec.vocab_size, "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size or spec.hidden_size * 2,
        "num_hidden_layers": spec.num_layers, "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads, "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "tie_word_embeddings": spec.tie_word_embeddings,
        "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "float32", "use_cache": True,
    }
    if spec.rope_scaling:
        config["rope_scaling"] = spec.rope_scaling
    if spec.arch == "llama":
        config |= {"attention_bias": False, "mlp_bias": False}
    return config


def random_weights(config: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = CausalLM(config)
        for name, p in model.named_parameters():
            with torch.no_grad():
                if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                    p.copy_(1.0 + 0.1 * torch.randn_like(p))
                else:
                    p.normal_(0.0, 0.08)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight")
    return state


def corpus(seed: int, num_lines: int = 2000) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 14))) + rng.choice(".?!")
            for _ in range(num_lines)]


def train_tokenizer(vocab_size: int, seed: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus(seed), trainer=trainer)
    return tok


def make_tiny(out_dir: str | Path, spec: TinySpec = TinySpec()) -> Path:
    """Write the checkpoint into `out_dir` (created if needed); returns the folder."""
    folder = Path(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    config = hf_config(spec)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    weights = random_weights(ModelConfig.from_hf(config), spec.seed)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    train_tokenizer(spec.vocab_size, spec.seed).save(str(folder / "tokenizer.json"))
    tok_config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": SPECIALS[0],
                  "eos_token": SPECIALS[1], "pad_token": SPECIALS[1],
                  "model_max_length": spec.max_position_embeddings,
                  "chat_template": CHAT_TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    (folder / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 0, "eos_token_id": 1, "do_sample": False}, indent=2) + "\n")
    return folder
