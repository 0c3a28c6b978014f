"""One request inside the engine: its tokens, how many have KV, and the blocks that hold it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvpool.engine.blocks import chain_hash, prefix_block_hashes
from kvpool.engine.config import SamplingParams

SEED_SPACE = 1 << 64
"""torch generators take seeds in [0, 2^64): a request's per-position seed is taken modulo it,
so any 64-bit request seed is valid at every position."""

if TYPE_CHECKING:
    import torch


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One position's logprob: its token's, and the best alternatives, best first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    """(token id, logprob) of the most likely tokens there."""


@dataclass(slots=True)
class Sampled:
    """The token an engine step chose for a sequence, with its logprob if the request asks.
    Not frozen, as `StepOutput` (0.65 against 0.15 us to make one; one per output token)."""

    token_id: int
    logprob: TokenLogprob | None = None


class KVSource(enum.Enum):
    COMPUTE = "none"   # compute whatever the local cache (and the pool, if any) lacks
    POOL = "pool"      # the whole prompt's KV must come from the pool
    PUSH = "push"      # the prompt's KV was pushed into reserved blocks


@dataclass(eq=False)
class Sequence:
    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling: SamplingParams
    block_size: int
    root_hash: int
    prefill_only: bool = False
    """Stop after the first token and keep nothing running (a prefill worker's leg)."""
    kv_source: KVSource = KVSource.COMPUTE
    joins_prefilled: bool = False
    """The prompt was prefilled on another instance, whose blocks this one loads through its
    store connector beside its steps (vLLM's P/D decode leg): what is left of the prompt joins
    the running batch, priced by the emulated engine as a decode join, not a new prefill."""
    status: SeqStatus = SeqStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_committed_blocks: int = 0
    """Leading full blocks registered under their hash in the block manager."""
    num_cached_tokens: int = 0   # from the local prefix cache, at admission
    num_pool_tokens: int = 0     # loaded from the pool, at admission
    pool_load_s: float = 0.0     # time of that load
    finish_reason: str | None = None
    error: str | None = None
    block_hashes: list[int] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    """With `sampling.prompt_logprobs`: one entry per prompt token computed so far (the first
    token's is None: nothing predicts it)."""
    prompt_logprobs_sent: bool = False
    """They went out with the first output; a recompute after preemption does not redo them."""
    generator: torch.Generator | None = None
    """Made on first use, for sampling at temperature > 0 (the emulated engine never needs
    torch)."""

    def __post_init__(self) -> None:
        self.block_hashes = prefix_block_hashes(self.token_ids, self.block_size, self.root_hash)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def reuses_kv(self) -> bool:
        """Whether cached or pooled KV may stand in for computing the prompt: not when the
        prompt's own logprobs are wanted (a reused token has no logits)."""
        return self.sampling.prompt_logprobs is None

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.sampling.prompt_logprobs is not None and not self.prompt_logprobs_sent

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def num_blocks_needed(self) -> int:
        return -(-len(self.token_ids) // self.block_size)

    def sampling_generator(self) -> torch.Generator | None:
        """The generator for the next token. With a seed, each output position gets its own
        stream (seed, position), so a request split across a prefill and a decode worker
        samples exactly what it would on one."""
        if self.sampling.temperature == 0:
            return None
        if self.generator is None:
            import torch

            self.generator = torch.Generator()
            self.generator.seed()
        if self.sampling.seed is not None:
            position_seed = self.sampling.seed * 1_000_003 + self.num_output_tokens
            self.generator.manual_seed(position_seed % SEED_SPACE)  # any int64 seed
        return self.generator

    def append(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        if len(self.token_ids) % self.block_size == 0:
            parent = self.block_hashes[-1] if self.block_hashes else self.root_hash
            self.block_hashes.append(chain_hash(parent, self.token_ids[-self.block_size:]))

    def block_tokens(self, index: int) -> list[int]:
        return self.token_ids[index * self.block_size:(index + 1) * self.block_size]
