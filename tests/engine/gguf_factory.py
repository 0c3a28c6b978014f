"""A GGUF file written here from a Hugging Face checkpoint (the tiny model): llama.cpp's Q/K row
order by its documented rule, the checkpoint's own vocabulary and merges. Shared by the GGUF
import tests and the malformed-file tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import load_file

GGUF_NAMES = {"model.embed_tokens.weight": "token_embd.weight",
              "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
         "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate",
         "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"


def gguf_name(name: str) -> str:
    if name in GGUF_NAMES:
        return GGUF_NAMES[name]
    _, _, layer, rest = name.split(".", 3)
    module = rest.removesuffix(".weight")
    return f"blk.{layer}.{LAYER[module]}.weight"


def llama_cpp_order(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's conversion of a Q/K projection (its convert script's permute)."""
    return (w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2)
            .reshape(w.shape))


def write_gguf(model_dir: Path, path: Path, **meta: Any) -> Path:
    """`meta` overrides config.json's values in the file's metadata (not in the tensors), and
    may replace the merges or the chat template."""
    import gguf

    shapes = json.loads((model_dir / "config.json").read_text())
    cfg = shapes | meta
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    specials = {a["content"] for a in tok.get("added_tokens", []) if a.get("special")}
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([3 if t in specials else 1 for t, _ in vocab])
    w.add_token_merges(cfg.get("merges", merges))
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_chat_template(cfg.get("chat_template", TEMPLATE))
    for name, arr in load_file(str(model_dir / "model.safetensors")).items():
        if name.endswith("q_proj.weight"):
            arr = llama_cpp_order(arr, shapes["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            arr = llama_cpp_order(arr, shapes["num_key_value_heads"])
        w.add_tensor(gguf_name(name), arr.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
