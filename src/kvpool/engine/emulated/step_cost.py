"""What one engine step costs: the one pricing of a step's work, shared by the simulator
(sim/engine.py, sim/colocated.py) and the emulated engine (emulated/engine.py), so that a live
emulated run and its simulation charge the same seconds for the same step.

A step is one forward pass over its prompt chunks and its running decodes (`StepWork`); how
an engine of a given kind is charged for it is data (`StepRules`):

    chunk   linear * tokens + quadratic * (end^2 - start^2), + prefill_base at a prompt's
            first chunk (or once for the whole step with `shared_base`, a batch of whole
            prompts); a first chunk overlaps loading its reused prefix (`load_prefix`:
            max(compute, start * load_s_per_token), CostModel.prefill_with_load_s)
    decode  CostModel.decode_step_s(decodes, context), + `eager_decode_s` when a decode-only
            step's longest context exceeds `graph_max_context` (vLLM's CUDA-graph limit)
    mixed   one pass: the weights are read once, so the decode step's fixed term hides under
            the chunks' compute: max(chunks, decode_base) + decode - decode_base
    chunked + `chunk_overhead_s` on a mixed step, and on a chunks-only step too with
            `overhead_alone` (vLLM's chunked prefill runs every such step eagerly)
    joins   + CostModel.decode_join_s for each decode joining with KV from another instance
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.conductor.cost import CostModel
from kvpool.errors import ConfigError


@dataclass(frozen=True, slots=True)
class PromptChunk:
    """Prompt tokens [start, start + num_tokens) computed in one step; `first` when the chunk
    begins the prompt's compute (after the prefix found in the cache or the pool)."""

    start: int
    num_tokens: int
    first: bool


@dataclass(frozen=True, slots=True)
class StepWork:
    """The work of one step."""

    chunks: tuple[PromptChunk, ...] = ()
    num_decodes: int = 0
    decode_context: int = 0
    """KV tokens the decoding sequences hold before the step (their attention reads)."""
    longest_context: int = 0
    """The longest decoding sequence's KV tokens before the step."""
    joins: int = 0
    """Decodes that join the batch in this step with their KV from another instance."""


@dataclass(frozen=True, slots=True)
class StepRules:
    """How an engine of one kind is charged for a step, beside the cost model's terms."""

    shared_base: bool = False
    """A step of whole prompts pays `prefill_base_s` once, shared by its prompts."""
    load_prefix: bool = True
    """A prompt's reused prefix is loaded beside its compute (Mooncake's DRAM pool); off: it
    is resident in VRAM (vLLM's own prefix cache) and costs nothing."""
    chunk_overhead_s: float = 0.0
    """Extra seconds of a step that carries prompt chunks beside decodes."""
    overhead_alone: bool = False
    """A step of chunks without decodes pays `chunk_overhead_s` too."""
    graph_max_context: int = 0
    """A decode-only step whose longest context exceeds this runs eagerly (0: never)."""
    eager_decode_s: float = 0.0
    """Extra seconds of an eager decode-only step."""

    def __post_init__(self) -> None:
        for name in ("chunk_overhead_s", "graph_max_context", "eager_decode_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"StepRules.{name} must be >= 0, got {getattr(self, name)}")


def chunk_s(cost: CostModel, rules: StepRules, chunk: PromptChunk) -> float:
    """Seconds of one prompt chunk on its own (its prefill base included at its first chunk
    unless the step shares it)."""
    end = chunk.start + chunk.num_tokens
    compute = (cost.prefill_linear_s * chunk.num_tokens
               + cost.prefill_quadratic_s * (end * end - chunk.start * chunk.start))
    if not chunk.first:
        return compute
    if not rules.shared_base:
        compute += cost.prefill_base_s
    if rules.load_prefix:
        compute = max(compute, chunk.start * cost.load_s_per_token)
    return compute


def step_s(cost: CostModel, rules: StepRules, work: StepWork) -> float:
    """Seconds of one step of `work` (see the module's table)."""
    joins = cost.decode_join_s * work.joins
    if not work.chunks:
        if not work.num_decodes:
            return joins
        step = cost.decode_step_s(work.num_decodes, work.decode_context)
        if rules.graph_max_context and work.longest_context > rules.graph_max_context:
            step += rules.eager_decode_s
        return step + joins
    prefill = sum(chunk_s(cost, rules, ch) for ch in work.chunks)
    if rules.shared_base:
        prefill += cost.prefill_base_s
    if not work.num_decodes:
        return prefill + (rules.chunk_overhead_s if rules.overhead_alone else 0.0) + joins
    decode = cost.decode_step_s(work.num_decodes, work.decode_context)
    return (max(prefill, cost.decode_base_s) + decode - cost.decode_base_s
            + rules.chunk_overhead_s + joins)
