"""A Llama-family decoder (Llama, Qwen2) in plain torch, attending over a paged KV cache.

Module and parameter names follow the Hugging Face checkpoints (`model.layers.0.self_attn.q_proj`
...), so a checkpoint's state dict loads as it is. One forward computes a flat batch of new
tokens from several sequences (prompt chunks and decode steps alike):

    input_ids [T]  positions [T]  ->  hidden [T, H]        T = sum of new tokens over sequences

Each layer writes the new tokens' K and V into the cache at `batch.slots`. A whole prompt
attends over its own new K/V (causal); a later prompt chunk over its sequence's blocks, gathered
through its block table, with a causal mask offset by the tokens it had already computed; all
decode tokens together over their block tables padded to one width, with a length mask.

One layer's cache is [num_blocks, 2, block_size, nkv, D] (kv_cache.py): a block's K then V.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from kvpool.engine.config import ModelConfig

LayerHook = Callable[[int], None]


@dataclass
class SeqSlice:
    """One sequence's part of a flat batch."""

    start: int          # first row of this sequence in the batch's T tokens
    num_new: int        # tokens computed now
    context_len: int    # tokens with KV after this step (computed before + num_new)
    block_table: torch.Tensor  # [num_blocks_of_seq] int64 block ids


@dataclass
class DecodeGroup:
    """Sequences computing one token each, attended together over padded block tables."""

    rows: torch.Tensor    # [B] int64: their rows in the batch's T tokens
    tables: torch.Tensor  # [B, max_blocks] int64 block ids (padded with block 0)
    max_len: int          # the longest context: keys past it are never attended
    mask: torch.Tensor | None  # [B, 1, 1, max_len] bool: key < context_len; None: all equal


@dataclass
class AttentionBatch:
    slots: torch.Tensor  # [T] int64: block_id * block_size + offset of each new token
    seqs: list[SeqSlice]  # prompt chunks, attended one sequence at a time
    decode: DecodeGroup | None = None
    _rows: torch.Tensor | None = field(default=None, repr=False)

    def cache_rows(self, block_size: int) -> torch.Tensor:
        """[T] row of each new token's K in a layer's cache viewed as
        [num_blocks * 2 * block_size, nkv, D]; its V is block_size rows further. The same
        for every layer, so computed once."""
        if self._rows is None:
            self._rows = self.slots + self.slots // block_size * block_size
        return self._rows


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim/2], with the config's rope scaling applied."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / float(scaling["factor"])
    return _llama3_inv_freq(inv_freq, scaling)


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between."""
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > old_len / low, inv_freq / factor, blended)
    return torch.where(wavelen < old_len / high, inv_freq, out)


class Rotary(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)

    inv_freq: torch.Tensor

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)                               # [T, D]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D]; rotate the two halves of each head."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


QUERY_BLOCK = 256
"""Queries per score matrix in `causal_attention`: [heads, 256, context] floats at a time."""


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [n, nh, D], the last n of ctx positions; k, v [ctx, nkv, D] -> [n, nh, D], each query
    seeing the keys up to its own position.

    In blocks of QUERY_BLOCK queries, each against the keys up to its last query only (a long
    prompt skips about half the scores, as a causal kernel does), with the heads that share a
    K/V head stacked into one matmul (no repeated K/V). Plain matmuls and one softmax: on CPU
    this is several times faster than scaled_dot_product_attention's kernels for long
    prompts (the 4k-token TTFT rows of `kvpool bench engine`), and exact within float error."""
    n, nh, D = q.shape
    ctx, nkv = k.shape[0], k.shape[1]
    group, offset = nh // nkv, ctx - n
    kt, vh = k.permute(1, 2, 0), v.transpose(0, 1)                  # [nkv, D, ctx], [nkv, ctx, D]
    keys = torch.arange(ctx, device=q.device)
    out = torch.empty_like(q)
    for start in range(0, n, QUERY_BLOCK):
        b, end = min(QUERY_BLOCK, n - start), offset + min(start + QUERY_BLOCK, n)
        qb = (q[start:start + b] * D ** -0.5).view(b, nkv, group, D)
        qb = qb.permute(1, 2, 0, 3).reshape(nkv, group * b, D)      # [nkv, group * b, D]
        scores = torch.matmul(qb, kt[:, :, :end])                    # [nkv, group * b, end]
        first = offset + start  # every query of the block sees keys before its first one
        pos = torch.arange(first, first + b, device=q.device)
        future = keys[None, first:end] > pos[:, None]               # [b, end - first]
        scores.view(nkv, group, b, end)[..., first:].masked_fill_(future, float("-inf"))
        ob = torch.matmul(torch.softmax(scores, dim=-1), vh[:, :end])  # [nkv, group * b, D]
        out[start:start + b] = ob.view(nkv, group, b, D).permute(2, 0, 1, 3).reshape(b, nh, D)
    return out


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        h, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        T = x.shape[0]
        q = self.q_proj(x).view(T, self.num_heads, self.head_dim)     # [T, nh, D]
        k = self.k_proj(x).view(T, self.num_kv_heads, self.head_dim)  # [T, nkv, D]
        v = self.v_proj(x).view(T, self.num_kv_heads, self.head_dim)  # [T, nkv, D]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        block_size = cache.shape[2]                           # cache [num_blocks, 2, B, nkv, D]
        flat = cache.view(-1, self.num_kv_heads, self.head_dim)  # [num_blocks * 2 * B, nkv, D]
        rows = batch.cache_rows(block_size)
        flat[rows] = k
        flat[rows + block_size] = v
        if batch.decode is not None and not batch.seqs:  # one token per sequence, in order
            return self.o_proj(self._attend_decode(q, cache, batch.decode).reshape(T, -1))
        out = torch.empty_like(q)                             # [T, nh, D]
        if batch.decode is not None:
            out[batch.decode.rows] = self._attend_decode(q[batch.decode.rows], cache, batch.decode)
        for s in batch.seqs:
            new = slice(s.start, s.start + s.num_new)
            if s.num_new == s.context_len:  # nothing before this chunk: its own K/V suffice
                out[new] = causal_attention(q[new], k[new], v[new])
            else:
                out[new] = causal_attention(q[new], *self._gather(cache, s))
        return self.o_proj(out.view(T, -1))

    @staticmethod
    def _gather(cache: torch.Tensor, s: SeqSlice) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [context_len, nkv, D] of one sequence, from its blocks."""
        table = s.block_table[:-(-s.context_len // cache.shape[2])]   # the blocks holding it
        k = cache[:, 0][table].flatten(0, 1)[:s.context_len]
        v = cache[:, 1][table].flatten(0, 1)[:s.context_len]
        return k, v

    @staticmethod
    def _attend_decode(q: torch.Tensor, cache: torch.Tensor, d: DecodeGroup) -> torch.Tensor:
        # Gathering K and V apart leaves each [B, W, bs, nkv, D] contiguous, so the merge of
        # W and bs below is a view: one copy of the context per step, as a growing cache has.
        k = cache[:, 0][d.tables].flatten(1, 2)[:, :d.max_len].transpose(1, 2)  # [B, nkv, L, D]
        v = cache[:, 1][d.tables].flatten(1, 2)[:, :d.max_len].transpose(1, 2)  # [B, nkv, L, D]
        o = F.scaled_dot_product_attention(q[:, :, None, :], k, v, attn_mask=d.mask,
                                           enable_gqa=True)   # [B, nh, 1, D]
        return o[:, :, 0]                                      # [B, nh, D]


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, batch)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = Rotary(config)


class CausalLM(nn.Module):
    """The whole model. `kv` is the cache: [num_layers, num_blocks, 2, block_size, nkv, D]."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Backbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                kv: torch.Tensor, on_layer: LayerHook | None = None) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)                  # [T, H]
        cos, sin = self.model.rotary(positions, x.dtype)        # [T, D] each
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, kv[i], batch)                # [T, H]; kv[i] now holds T more
            if on_layer is not None:
                on_layer(i)
        return self.model.norm(x)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()                     # [N, vocab]
