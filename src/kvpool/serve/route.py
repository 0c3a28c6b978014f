"""What the conductor did with a request, told to its client and its access line.

Response headers (sent with the first token, so they say what was known then):

    x-kvpool-prefill-worker      URL of the prefill leg ("-": sent straight to decode)
    x-kvpool-decode-worker       URL of the decode leg as booked
    x-kvpool-reused-tokens       local=N,pool=M: prompt tokens whose KV was reused, from the
                                 prefill worker's own cache and from the pool
    x-kvpool-predicted-ttft-ms   the conductor's TTFT prediction when it placed the request

The access line ends with the same, as the request ended: the decode worker it ended on (a
migrated stream names its last one) and the reuse reported by then (a colocated request's
reuse is known only at its finish). For `n` > 1 or several prompts, the first choice's.
"""

from __future__ import annotations

from kvpool.serve.run import Run


def route_headers(run: Run) -> dict[str, str]:
    b = run.b
    return {"x-kvpool-prefill-worker": "-" if b.direct else b.prefill.url,
            "x-kvpool-decode-worker": b.decode.url,
            "x-kvpool-reused-tokens": f"local={run.cached_len - run.pool_len},"
                                      f"pool={run.pool_len}",
            "x-kvpool-predicted-ttft-ms": f"{b.decision.prefill.ttft_s * 1e3:.0f}"}


def route_note(run: Run) -> str:
    b = run.b
    prefill = "-" if b.direct else b.prefill.url
    return (f"prefill={prefill} decode={run.decode_url} "
            f"reused=local:{run.cached_len - run.pool_len},pool:{run.pool_len} "
            f"predicted_ttft={b.decision.prefill.ttft_s * 1e3:.0f}ms")
