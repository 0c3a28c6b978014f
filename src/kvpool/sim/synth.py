"""Seeded synthetic workloads: lists of `TraceRequest` with chosen length distributions and a
target cache ratio, realised through shared prefixes.

Construction (`generate`):
- requests come in *groups* of `group_size` consecutive requests about one *document*: the
  group's requests share the input length and the document's leading blocks, and each has its
  own unique tail (its question);
- a document is either fresh for every group (`pool` = 0: L-Eval, a dataset read in its own
  order) or drawn uniformly from a pool of `pool` documents (the simulated data of [A] §8.1.2);
- the shared part is `shared_blocks(...)` of a request's 512-token blocks: the share
  `doc_share` of them, rounded, keeping at least one unique block.

Once warm (every document seen once) the share of prompt tokens whose KV can be reused is
`doc_share` with a pool and `doc_share * (group_size - 1) / group_size` with fresh documents;
`WorkloadSpec.with_ratio` picks `doc_share` from a target ratio. `cache_ratio(reqs)` measures
the realised share on an unbounded cache (cold misses included).

Block ids are prefix-chained, as in the Mooncake traces: two requests share KV exactly as far
as their hash tuples agree. Lengths are drawn from `LengthDist` (fixed, or a lognormal with a
given mean and coefficient of variation, clipped); arrivals are Poisson (`with_rate`).
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from itertools import count

from kvpool.errors import InvalidArgument
from kvpool.sim.trace import TraceRequest, poisson_arrivals

BLOCK_TOKENS = 512
"""Tokens per hashed block, as in the Mooncake traces."""


@dataclass(frozen=True, slots=True)
class LengthDist:
    """A token-length distribution: `mean` exactly when `cv` = 0, else a lognormal with that
    mean and coefficient of variation (std / mean), rounded and clipped to [lo, hi]."""

    mean: int
    cv: float = 0.0
    lo: int = 1
    hi: int | None = None

    def __post_init__(self) -> None:
        if self.mean < 1 or self.cv < 0 or self.lo < 1:
            raise InvalidArgument(f"need mean >= 1, cv >= 0, lo >= 1; got {self}")
        if self.hi is not None and self.hi < self.lo:
            raise InvalidArgument(f"need hi >= lo, got {self}")

    def sample(self, rng: random.Random) -> int:
        if self.cv == 0:
            return self.mean
        sigma = math.sqrt(math.log1p(self.cv * self.cv))
        value = round(rng.lognormvariate(math.log(self.mean) - sigma * sigma / 2, sigma))
        return max(self.lo, min(value, self.hi if self.hi is not None else value))


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    name: str
    input_len: LengthDist
    output_len: LengthDist
    doc_share: float = 0.0
    """Share of each request's blocks that is its document's (0 = nothing shared)."""
    group_size: int = 1
    """Consecutive requests about one document (same input length)."""
    pool: int = 0
    """Documents to draw from (0 = a fresh document for every group)."""

    def __post_init__(self) -> None:
        if not 0 <= self.doc_share <= 1 or self.group_size < 1 or self.pool < 0:
            raise InvalidArgument(f"need 0 <= doc_share <= 1, group_size >= 1, pool >= 0: {self}")

    def warm_ratio(self) -> float:
        """Reused share of prompt tokens once every document has been seen (ignoring the
        rounding of shared blocks)."""
        if self.pool:
            return self.doc_share
        return self.doc_share * (self.group_size - 1) / self.group_size

    def with_ratio(self, ratio: float) -> WorkloadSpec:
        """This spec with the `doc_share` whose warm ratio is `ratio`."""
        reuse = 1.0 if self.pool else (self.group_size - 1) / self.group_size
        if ratio > 0 and (reuse == 0 or ratio > reuse):
            raise InvalidArgument(f"{self.name}: ratio {ratio} unreachable with groups of "
                                  f"{self.group_size} and a pool of {self.pool}")
        return replace(self, doc_share=ratio / reuse if ratio else 0.0)


def shared_blocks(input_len: int, doc_share: float) -> int:
    """Leading blocks a request shares with its document: round(doc_share x blocks), at most
    blocks - 1 (every request keeps a unique tail) unless doc_share is 1."""
    blocks = -(-input_len // BLOCK_TOKENS)
    shared = round(doc_share * blocks)
    return shared if doc_share >= 1 else min(shared, blocks - 1)


def generate(spec: WorkloadSpec, num_requests: int, seed: int = 0) -> list[TraceRequest]:
    """`num_requests` requests of `spec`, all arriving at 0 (see `with_rate`)."""
    if num_requests < 0:
        raise InvalidArgument(f"num_requests must be >= 0, got {num_requests}")
    rng = random.Random(seed)
    ids = count(1)
    docs = [_document(spec, rng, ids) for _ in range(spec.pool)]
    out: list[TraceRequest] = []
    while len(out) < num_requests:
        doc = rng.choice(docs) if docs else _document(spec, rng, ids)
        for _ in range(min(spec.group_size, num_requests - len(out))):
            out.append(_request(spec, len(out), doc, rng, ids))
    return out


def _document(spec: WorkloadSpec, rng: random.Random,
              ids: Iterator[int]) -> tuple[int, tuple[int, ...]]:
    """(input length, shared block ids) of one document."""
    n = spec.input_len.sample(rng)
    return n, tuple(next(ids) for _ in range(shared_blocks(n, spec.doc_share)))


def _request(spec: WorkloadSpec, rid: int, doc: tuple[int, tuple[int, ...]],
             rng: random.Random, ids: Iterator[int]) -> TraceRequest:
    n, head = doc
    tail = tuple(next(ids) for _ in range(-(-n // BLOCK_TOKENS) - len(head)))
    return TraceRequest(rid, 0.0, n, spec.output_len.sample(rng), head + tail)


def with_rate(reqs: Sequence[TraceRequest], rate_per_s: float,
              seed: int = 0) -> list[TraceRequest]:
    """Poisson arrivals at `rate_per_s`; with one seed, the arrival times of two rates differ
    only by their scale (the same exponential draws divided by the rate)."""
    return poisson_arrivals(reqs, rate_per_s, seed)


def cache_ratio(reqs: Sequence[TraceRequest]) -> float:
    """Share of prompt tokens in leading blocks that an earlier request already had (an
    unbounded cache, cold misses included)."""
    seen: set[int] = set()
    reused = total = 0
    for r in sorted(reqs, key=lambda q: (q.arrival_s, q.request_id)):
        hits = next((i for i, b in enumerate(r.block_hashes) if b not in seen),
                    len(r.block_hashes))
        reused += min(hits * BLOCK_TOKENS, r.input_len)
        total += r.input_len
        seen.update(r.block_hashes)
    return reused / total if total else 0.0


def simulated(input_len: int, ratio: float = 0.5, pool: int = 8) -> WorkloadSpec:
    """[A] Table 2 'Simulated': fixed input, 512 output tokens, 50% cache ratio. [A] does not
    say how the reuse arises; kvpool draws each request's first half from a pool of `pool`
    documents."""
    return WorkloadSpec(f"simulated_{input_len // 1024}k", LengthDist(input_len),
                        LengthDist(512), pool=pool).with_ratio(ratio)


ARXIV = WorkloadSpec("arxiv", LengthDist(8088, 0.5, 512, 32_768), LengthDist(229, 0.5, 16, 1024))
"""[A] Table 2 'ArXiv Summarization': only the means (8088 in / 229 out) and the ~0% cache
ratio are published. kvpool draws both lengths from lognormals with cv 0.5 (inputs clipped to
[512, 32k], outputs to [16, 1024]); every request is its own document (nothing shared)."""

LEVAL = WorkloadSpec("l-eval", LengthDist(19019, 0.5, 2048, 65_536), LengthDist(72, 0.5, 4, 512),
                     group_size=8).with_ratio(0.85)
"""[A] Table 2 'L-Eval': only the means (19019 in / 72 out) and the >80% cache ratio are
published. kvpool: long documents (lognormal length, cv 0.5, clipped to [2k, 64k]) each asked
8 questions in a row; a question shares all but its last ~3% of the prompt with the others
(doc_share 0.971), so the warm cache ratio is 0.85; outputs lognormal, cv 0.5."""
