"""The serving benchmark's pure parts: prompt synthesis from trace hash ids, and the summary."""

from __future__ import annotations

from kvpool.bench.serve import (
    BenchResult,
    block_ids,
    calibration_requests,
    summarise,
    synthesise,
)
from kvpool.sim.trace import TraceRequest

VOCAB = range(16, 512)


def test_prompts_share_prefixes_exactly_where_hash_ids_repeat() -> None:
    trace = [TraceRequest(0, 0.0, 2048, 512, (1, 2, 3, 4)),
             TraceRequest(1, 1.0, 1600, 100, (1, 2, 9, 10)),
             TraceRequest(2, 2.0, 100000, 5000, tuple(range(100, 300)))]
    a, b, c = synthesise(trace, 16, VOCAB, max_model_len=256, max_output=8)
    assert len(a.prompt_ids) == 64 and a.max_tokens == 8  # 2048 * 16/512, output capped
    assert a.prompt_ids[:32] == b.prompt_ids[:32] == block_ids(1, 16, VOCAB) + block_ids(2, 16, VOCAB)
    assert a.prompt_ids[32:48] != b.prompt_ids[32:48]
    assert len(b.prompt_ids) == 50 and b.max_tokens == 3
    assert len(c.prompt_ids) == 256 - 8 - 1  # cut to the context
    assert all(t in VOCAB for t in a.prompt_ids + c.prompt_ids)


def test_summary_percentiles_rates_and_reasons() -> None:
    ok = [BenchResult(200, ttft_s=0.1 * i, gaps_s=[0.01], prompt_tokens=100,
                      cached_tokens=50, output_tokens=4) for i in range(1, 5)]
    refused = [BenchResult(429, reason="ttft"), BenchResult(429, reason="kv_capacity")]
    row = summarise(ok + refused + [BenchResult(502)], wall_s=2.0)
    assert (row["requests"], row["ok"], row["rejected"], row["failed"]) == (7, 4, 2, 1)
    assert row["rejected_by"] == {"kv_capacity": 1, "ttft": 1}
    assert row["ttft_p50_ms"] == 250.0 and row["tbt_p99_ms"] == 10.0
    assert row["output_tok_per_s"] == 8.0 and row["prefix_hit_rate"] == 0.5


def test_calibration_prompts_span_the_slice_and_share_nothing_with_it() -> None:
    trace = [TraceRequest(0, 0.0, 2048, 512, (1, 2, 3, 4)),
             TraceRequest(1, 1.0, 1600, 100, (1, 2, 9, 10))]
    reqs = synthesise(trace, 16, VOCAB, max_model_len=256, max_output=8)
    cal = calibration_requests(reqs, 4, VOCAB)
    assert [len(r.prompt_ids) for r in cal] == [50, 55, 59, 64]  # 50 .. 64 evenly
    assert all(r.max_tokens == 2 and r.arrival_s == 0.0 for r in cal)
    firsts = {tuple(r.prompt_ids[:16]) for r in reqs + cal}
    assert len(firsts) == 1 + 4  # the two trace prompts share their first block, nothing else
    assert calibration_requests(reqs, 0, VOCAB) == []
