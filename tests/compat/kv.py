"""KV-cache-shaped CPU tensors for the compat tests (page-first layout)."""

from __future__ import annotations

import hashlib

import torch

NUM_LAYERS = 32
PAGE_SHAPE = (NUM_LAYERS, 2, 4, 2, 8)
"""One page: layers x (K, V) x tokens x heads x head_dim, float16 -> 8 KiB."""
PAGE_BYTES = 32 * 2 * 4 * 2 * 8 * 2


def kv_cache(num_pages: int, seed: int) -> torch.Tensor:
    """[num_pages, *PAGE_SHAPE] float16 with contents fixed by `seed`."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn((num_pages, *PAGE_SHAPE), generator=gen).to(torch.float16)


def page_digest(cache: torch.Tensor, pages: list[int]) -> str:
    h = hashlib.sha256()
    for p in pages:
        h.update(cache[p].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def merge_runs(src_pages: list[int], dst_pages: list[int]) -> list[tuple[int, int, int]]:
    """(src page, dst page, count) runs where both sides are contiguous, as the vLLM and SGLang
    connectors merge descriptors before a batch write."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src_pages, dst_pages, strict=True):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs
