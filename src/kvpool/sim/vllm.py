"""Settings of the colocated baseline that model documented vLLM v0.5.1 behaviour.

Each field is one behaviour, on by default; `VllmConfig.off()` turns them all off. The values
are vLLM v0.5.1 defaults, except `chunk_overhead_s`, which is calibrated (docs/sim.md, 3): the
extra cost of a mixed step (it runs eagerly, with less efficient kernels), and
`eager_decode_s`, derived from [A] Fig.12: what a decode-only step above
`max_seq_len_to_capture` costs for running without a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.engine.emulated.step_cost import StepRules
from kvpool.errors import ConfigError

CHUNK_OVERHEAD_S = 0.0225
"""Extra seconds of every step that carries a prefill chunk. Calibrated (not derived) so that
vLLM with chunked prefill spends 1.90x Mooncake's prefill GPU time per request on the
conversation trace, as in [F] Fig.8; see docs/sim.md."""

EAGER_DECODE_S = 0.008
"""Extra seconds of a decode-only step run eagerly (a context over `max_seq_len_to_capture`)
against one replayed from a CUDA graph. Derived from [A] Fig.12, the papers' one measurement
of vLLM v0.5 decoding long contexts alone: vLLM-[4M] serves ~0.2 RPS of 16k prompts one at a
time on 4 instances, 20 s a request; less the 2.11 s prefill, 511 steps of 35.0 ms, against
the microbenchmark's 26.8 ms lone step at 16k ([F] Fig.14): 8 ms more."""


@dataclass(frozen=True, slots=True)
class VllmConfig:
    """Documented vLLM v0.5.1 behaviour the baseline models; `VllmConfig.off()` is the plain
    one-prompt-at-a-time model."""

    batch_prefills: bool = True
    """Several waiting prompts share one prefill step (default scheduler) or one chunk budget
    (chunked prefill), as vLLM's scheduler fills its token budget from the waiting queue."""
    max_num_batched_tokens: int = 131_072
    """Token budget of one prefill step without chunked prefill: vLLM's default
    max(max_model_len, 2048), with max_model_len 128k to serve the trace's 126k prompts."""
    max_num_seqs: int = 256
    """vLLM's default limit on the sequences an instance runs at once: a prompt starts only
    while the running, joining and prefilling ones are fewer (1 = one request at a time: the
    next prompt waits until the running request has finished decoding)."""
    chunk_overhead_s: float = CHUNK_OVERHEAD_S
    """Fixed cost of every step that carries prefill chunks (chunked prefill only): mixed
    steps run eagerly (CUDA graphs cover decode-only batches) with less efficient kernels."""
    shared_vram_cache: bool = True
    """The prefix cache holds only blocks that the KV of running requests leaves free."""
    preempt_recompute: bool = True
    """KV allocated on demand; the newest running request is preempted and recomputed when
    a decode step finds no free slot (vLLM's default preemption mode for single sequences)."""
    watermark: float = 0.01
    """Share of the KV capacity a new prompt must leave free (vLLM's default watermark)."""
    max_seq_len_to_capture: int = 8192
    """vLLM v0.5.1 replays a decode-only step from a captured CUDA graph only while every
    running sequence's context is at most this many tokens (its default); a longer one runs
    the step eagerly, which costs `eager_decode_s` more. 0 = every decode step runs from a
    graph."""
    eager_decode_s: float = EAGER_DECODE_S
    """Extra seconds of an eager decode-only step (see EAGER_DECODE_S)."""

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens <= 0 or self.max_num_seqs <= 0:
            raise ConfigError(
                f"max_num_batched_tokens and max_num_seqs must be > 0, got "
                f"{self.max_num_batched_tokens}, {self.max_num_seqs}")
        if self.chunk_overhead_s < 0:
            raise ConfigError(f"chunk_overhead_s must be >= 0, got {self.chunk_overhead_s}")
        if self.eager_decode_s < 0:
            raise ConfigError(f"eager_decode_s must be >= 0, got {self.eager_decode_s}")
        if self.max_seq_len_to_capture < 0:
            raise ConfigError(f"max_seq_len_to_capture must be >= 0, got "
                              f"{self.max_seq_len_to_capture}")
        if not 0 <= self.watermark < 1:
            raise ConfigError(f"watermark must be in [0, 1), got {self.watermark}")

    def step_rules(self, chunked: bool) -> StepRules:
        """How a step of this vLLM is charged (emulated/step_cost.py): its prefix cache is in
        VRAM (nothing loaded); with chunked prefill every step carrying a chunk pays
        `chunk_overhead_s`, and without it a step of whole prompts pays the prefill base once;
        decode-only steps over `max_seq_len_to_capture` pay `eager_decode_s`."""
        return StepRules(shared_base=not chunked, load_prefix=False,
                         chunk_overhead_s=self.chunk_overhead_s if chunked else 0.0,
                         overhead_alone=chunked, graph_max_context=self.max_seq_len_to_capture,
                         eager_decode_s=self.eager_decode_s)

    @classmethod
    def off(cls) -> VllmConfig:
        return cls(batch_prefills=False, chunk_overhead_s=0.0, shared_vram_cache=False,
                   preempt_recompute=False, max_seq_len_to_capture=0)
