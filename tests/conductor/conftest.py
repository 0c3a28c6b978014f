"""Factories for conductor tests: a cost model with round numbers so TTFTs can be worked by hand.

SIMPLE_COST: prefill 1 ms per new token, nothing else; decode 10 ms per step; KV transfer
1 us per token (1000 bytes per token over 8 Gbps at full efficiency).
"""

from __future__ import annotations

import pytest

from kvpool.conductor import ClusterView, CostModel, RequestInfo

SIMPLE_COST = CostModel(
    prefill_base_s=0.0, prefill_linear_s=0.001, prefill_quadratic_s=0.0,
    decode_base_s=0.01, decode_per_seq_s=0.0, decode_per_token_s=0.0,
    kv_bytes_per_token=1000, bandwidth_gbps=8.0, link_efficiency=1.0, load_s_per_token=0.0)


def req(rid: int, blocks: list[int], input_len: int | None = None,
        output_len: int = 4) -> RequestInfo:
    return RequestInfo(rid, input_len if input_len is not None else 512 * len(blocks),
                       output_len, tuple(blocks))


def view_with(holdings: dict[int, list[int]], num_prefill: int = 2, num_decode: int = 2,
              kv_capacity_tokens: int = 1_000_000) -> ClusterView:
    view = ClusterView.create(num_prefill, num_decode, kv_capacity_tokens)
    for inst, blocks in holdings.items():
        for b in blocks:
            view.index.add(inst, b)
    return view


@pytest.fixture
def cost() -> CostModel:
    return SIMPLE_COST
