"""`kvpool bench engine`'s prefill-penalty rows: a cold prompt's time to first token on a
colocated worker (it computes the prompt and keeps its KV) beside the same prompt on a
disaggregated prefill worker, which also hands the KV over while it computes: to the pool
(`pool`: layer-wise puts overlapped with the forward) or straight into a decode worker's
reserved blocks (`push`). Real master, store node and three worker processes on one model; one
fresh prompt per repeat, the three layouts in a rotating order; medians.

The colocated TTFT is the first line of its /generate stream; the disaggregated one is the
/prefill reply (the first token, sent once the KV is handed over); the decode leg then finishes
each request, untimed, so every run frees its KV.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvpool.launch.engines import start_engines

if TYPE_CHECKING:
    from kvpool.engine.worker.messages import KVMode

LAYOUTS = ("colocated", "pool", "push")


@dataclass(frozen=True)
class Fleet:
    both: str
    prefill: str
    decode: str


def prefill_penalty(model_dir: Path, length: int, vocab: int,
                    repeats: int) -> list[dict[str, Any]]:
    """One row per layout: the median cold TTFT (ms), and vs_colocated for the other two."""
    import random

    rng = random.Random(7)
    runs: dict[str, list[float]] = {name: [] for name in LAYOUTS}
    with _fleet(model_dir, length) as fleet:
        timers = _timers(fleet)
        for name in LAYOUTS:  # one-time costs (connections, allocator) outside the medians
            timers[name]([rng.randrange(vocab) for _ in range(64)])
        for rep in range(repeats):
            for name in LAYOUTS[rep % 3:] + LAYOUTS[:rep % 3]:
                runs[name].append(timers[name]([rng.randrange(vocab) for _ in range(length)]))
    base = statistics.median(runs["colocated"])
    rows = []
    for name in LAYOUTS:
        value = statistics.median(runs[name])
        row: dict[str, Any] = {"impl": "kvpool worker", "phase": f"TTFT cold, {name}",
                               "value": round(value, 1), "unit": "ms", "prompt_len": length,
                               "runs_ms": [round(ms) for ms in runs[name]]}
        if name != "colocated":
            row["vs_colocated"] = round(value / base, 3)
        rows.append(row)
    return rows


def _timers(fleet: Fleet) -> dict[str, Callable[[list[int]], float]]:
    """Per layout: run one request to its end; the milliseconds to its first token."""
    import uuid

    from kvpool.engine.config import SamplingParams
    from kvpool.engine.worker.client import prefill, stream
    from kvpool.engine.worker.messages import GenerateRequest, KVTransfer, PrefillRequest

    sampling = SamplingParams(max_tokens=2, ignore_eos=True)

    def colocated(prompt: list[int]) -> float:
        req = GenerateRequest(request_id=uuid.uuid4().hex, prompt_token_ids=prompt,
                              sampling=sampling)
        t0, first = time.perf_counter(), None
        for _ in stream(fleet.both, req):
            first = first or time.perf_counter()
        return ((first or time.perf_counter()) - t0) * 1e3

    def disaggregated(mode: KVMode) -> Callable[[list[int]], float]:
        def run(prompt: list[int]) -> float:
            rid = uuid.uuid4().hex
            kv = KVTransfer(mode=mode, decode_url=fleet.decode if mode == "push" else None)
            t0 = time.perf_counter()
            reply = prefill(fleet.prefill, PrefillRequest(
                request_id=rid, prompt_token_ids=prompt, sampling=sampling, kv_transfer=kv))
            ms = (time.perf_counter() - t0) * 1e3
            for _ in stream(fleet.decode, GenerateRequest(
                    request_id=rid, prompt_token_ids=prompt, sampling=sampling,
                    first_token_id=reply.first_token_id, kv_source=mode)):
                pass
            return ms
        return run

    return {"colocated": colocated, "pool": disaggregated("pool"),
            "push": disaggregated("push")}


@contextmanager
def _fleet(model_dir: Path, length: int) -> Iterator[Fleet]:
    """Master, one store node, and a `both`, a `prefill` and a `decode` worker alike in every
    engine flag (one chunk for the whole prompt, blocks for a few of them)."""
    engine = ("--model", str(model_dir), "--max-prefill-chunk", str(length),
              "--max-model-len", str(length + 64), "--num-blocks", str(length // 16 * 3 + 64))
    with ExitStack() as stack:
        fleet = start_engines(stack, [("--role", role, *engine)
                                      for role in ("both", "prefill", "decode")])
        yield Fleet(*fleet.urls)
