"""EngineCore: requests in, tokens out, one `step()` at a time, whatever computes the tokens.

    engine.add_request("r1", prompt_ids, SamplingParams(max_tokens=8))
    while engine.has_work:
        for out in engine.step(): ...          # StepOutput per new token / finish

`step()` is schedule -> run -> postprocess. The scheduler (continuous batching, chunked
prefill, preemption), the block manager with its chained prefix hashes, and the KV connector
(pool, push) are the same for every engine; a subclass supplies the KV layout and `run(batch)`:
`LLMEngine` runs the torch model, `emulated.EmulatedEngine` sleeps for a profile's step time.
The engine is single-threaded: callers that serve several clients (the workers) drive it from
one thread. No torch here.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvpool.clock import SYSTEM_CLOCK, Clock
from kvpool.engine.block_manager import BlockManager
from kvpool.engine.blocks import salted_root
from kvpool.engine.config import EngineConfig, SamplingParams
from kvpool.engine.connector import KVConnector, NullConnector
from kvpool.engine.kv_layout import KVLayout
from kvpool.engine.scheduler import ScheduledBatch, Scheduler
from kvpool.engine.sequence import KVSource, Sampled, SeqStatus, Sequence, TokenLogprob
from kvpool.errors import InvalidArgument

T = TypeVar("T")


@dataclass(slots=True)
class StepOutput:
    """One request's output of an engine step (a token, a finish or an error). Not frozen:
    a frozen dataclass sets each field through object.__setattr__, 2.0 against 0.7 us to make
    one, and one is made per output token; nothing changes one after the step."""

    request_id: str
    token_id: int | None = None
    finish_reason: str | None = None
    error: str | None = None
    stats: dict[str, float] = field(default_factory=dict)
    """The request's figures (`EngineCore.stats`): with its finish, and with its first output
    token (the prompt's reuse is known then: a stream cut short still reports it)."""
    time_s: float = 0.0
    """The engine clock when the step that made this output ended (0 for outputs made between
    steps): TTFT and TBT are measured on these stamps, not on delivery."""
    logprob: TokenLogprob | None = None
    """The token's logprob, if the request asks (`SamplingParams.logprobs`)."""
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    """With the first output of a request that asks (`SamplingParams.prompt_logprobs`)."""


class EngineCore:
    def __init__(self, config: EngineConfig, cache: KVLayout, root_hash: int = 0,
                 connector: KVConnector | None = None, eos_ids: tuple[int, ...] = (),
                 clock: Clock = SYSTEM_CLOCK) -> None:
        self.config, self.cache, self.root_hash, self.clock = config, cache, root_hash, clock
        self.blocks = BlockManager(config.num_blocks, config.block_size)
        self.scheduler = Scheduler(config, self.blocks)
        self.connector = connector or NullConnector()
        self.eos_ids = set(eos_ids)
        self.vocab_size = 0
        """Token ids a request may hold are 0..vocab_size-1 (set by the engines; 0: none
        checked). An id past it would fail the batched step of every request with it."""
        self._finished: list[StepOutput] = []
        self.lost_s = 0.0
        """Seconds steps started late while work waited (the emulated engine measures it:
        its machine did not keep up with the emulated accelerator)."""
        self._failed: dict[Sequence, str] = {}
        """Sequences whose own work raised during this step (`isolated`): they end with the
        error, the rest of the batch goes on."""
        self.state_lock = threading.Lock()
        """Held by the thread that drives the engine while it changes state; an engine whose
        step waits without computing (the emulated one) lets readers in meanwhile."""

    # -- requests --------------------------------------------------------------------------

    def new_sequence(self, request_id: str, prompt: list[int], sampling: SamplingParams,
                     outputs: Iterable[int] = (), **kw: Any) -> Sequence:
        """`outputs`: tokens the request already produced elsewhere (a resumed request): they
        are computed with the prompt, count toward max_tokens, min_tokens, penalties and the
        seeded positions, and are not sent again."""
        done = list(outputs)
        if not prompt:
            raise InvalidArgument(f"request {request_id}: empty prompt")
        if len(done) >= sampling.max_tokens:
            raise InvalidArgument(f"request {request_id}: {len(done)} tokens already produced, "
                                  f"max_tokens is {sampling.max_tokens}: nothing to resume")
        tokens = list(prompt) + done
        self.check_tokens(request_id, tokens)
        if len(prompt) + sampling.max_tokens > self.config.max_model_len:
            raise InvalidArgument(f"request {request_id}: {len(prompt)} prompt tokens + "
                                  f"max_tokens {sampling.max_tokens} exceed max_model_len "
                                  f"{self.config.max_model_len}")
        if -(-(len(prompt) + sampling.max_tokens) // self.config.block_size) \
                > self.config.num_blocks:  # (else it preempts itself and stalls the queue)
            raise InvalidArgument(f"request {request_id}: {len(prompt)} prompt tokens + "
                                  f"max_tokens {sampling.max_tokens} do not fit in "
                                  f"{self.config.kv_capacity_tokens} tokens of KV cache")
        root = salted_root(self.root_hash, sampling.cache_salt)
        return Sequence(request_id, tokens, len(prompt), sampling, self.config.block_size,
                        root, **kw)

    def check_tokens(self, request_id: str, tokens: list[int]) -> None:
        """InvalidArgument for a token id outside the model's vocabulary (a forward over it
        would fail the step of every request in the batch)."""
        vocab = self.vocab_size
        if vocab and tokens and (min(tokens) < 0 or max(tokens) >= vocab):
            raise InvalidArgument(f"request {request_id}: a token id outside the model's "
                                  f"vocabulary (0..{vocab - 1})")

    def add_request(self, request_id: str, prompt: list[int], sampling: SamplingParams,
                    **kw: Any) -> Sequence:
        self.check_new_id(request_id)
        seq = self.new_sequence(request_id, prompt, sampling, **kw)
        self.scheduler.add(seq)
        return seq

    def check_new_id(self, request_id: str) -> None:
        """InvalidArgument when a request of this id runs here already."""
        if self.scheduler.find(request_id) is not None:
            raise InvalidArgument(f"request {request_id} is already running here")

    def abort(self, request_id: str, reason: str = "aborted") -> bool:
        seq = self.scheduler.find(request_id)
        if seq is None:
            return False
        self._finish(seq, None, reason)
        return True

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or bool(self._finished)

    # -- the loop --------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        self.connector.before_step()
        batch = self.scheduler.schedule(self._admit)
        sampled = self.run(batch) if batch else {}
        return self.postprocess(batch, sampled)

    def _admit(self, seq: Sequence) -> None:
        failure = self.connector.load(seq)
        if failure is not None:
            self._finish(seq, None, failure.reason)

    def run(self, batch: ScheduledBatch) -> dict[Sequence, Sampled]:
        """Compute the batch's KV; return the token sampled for each sequence whose last
        token was computed now."""
        raise NotImplementedError

    def isolated(self, seq: Sequence, fn: Callable[..., T], *args: object) -> T | None:
        """`fn(*args)`, work of `seq` alone: if it raises, `seq` ends with the error after this
        step and None is returned, so one request's failure (its sampling, its logprobs)
        cannot fail the others in the batch."""
        try:
            return fn(*args)
        except Exception as exc:
            self._failed[seq] = f"request {seq.request_id} failed in the engine: {exc!r}"
            return None

    @contextmanager
    def readers_in(self) -> Iterator[None]:
        """While the step computes or waits without changing the engine's state: let readers
        of it (a worker's /load) in, so a long step does not look like a dead worker. A no-op
        when the engine is driven directly (offline), without the lock held."""
        if not self.state_lock.locked():
            yield
            return
        self.state_lock.release()
        try:
            yield
        finally:
            self.state_lock.acquire()

    def has_failed(self, seq: Sequence) -> bool:
        return seq in self._failed

    def postprocess(self, batch: ScheduledBatch,
                    sampled: dict[Sequence, Sampled]) -> list[StepOutput]:
        """Advance each sequence of the batch by what it computed; append and report each
        sampled token (with the request's figures on its first output, its prompt logprobs
        once); finish what stops. Once per token of every step: written for speed (fields
        and lengths read directly, not through properties)."""
        outputs, self._finished = self._finished, []
        now = self.step_end_s()
        bs = self.blocks.block_size
        for seq, n in batch:
            computed = seq.num_computed_tokens = seq.num_computed_tokens + n
            if computed // bs > seq.num_committed_blocks:  # a block filled
                self.blocks.commit(seq)
            choice = sampled.get(seq)
            if choice is None:
                continue
            token = choice.token_id
            seq.append(token)
            out = StepOutput(seq.request_id, token, time_s=now, logprob=choice.logprob)
            if len(seq.token_ids) - seq.num_prompt_tokens == 1:
                out.stats = self.stats(seq)
            if seq.sampling.prompt_logprobs is not None:
                out.prompt_logprobs = self._take_prompt_logprobs(seq)
            outputs.append(out)
            reason = self._stop_reason(seq)
            if reason is not None:
                self._finish(seq, reason)
        failed, self._failed = self._failed, {}
        for seq, why in failed.items():
            self._finish(seq, None, why)
        outputs, self._finished = outputs + self._finished, []
        return outputs

    @staticmethod
    def _take_prompt_logprobs(seq: Sequence) -> tuple[TokenLogprob | None, ...] | None:
        """The prompt logprobs, once, with the first output of a request that asks."""
        if not seq.wants_prompt_logprobs:
            return None
        seq.prompt_logprobs_sent = True
        return tuple(seq.prompt_logprobs)

    def step_end_s(self) -> float:
        """The stamp of the outputs of the step that just ran."""
        return self.clock.now()

    def _stop_reason(self, seq: Sequence) -> str | None:
        """Why `seq` ends after the token just appended, or None."""
        ids = seq.token_ids
        count = len(ids) - seq.num_prompt_tokens
        reason = self._reason(seq.sampling, ids[-1], count) if count else None
        if reason is None and (seq.prefill_only or len(ids) >= self.config.max_model_len):
            return "length"
        return reason

    def finish_reason_of(self, sampling: SamplingParams, outputs: list[int]) -> str | None:
        """Whether a request whose output so far is `outputs` is over: "stop" after a stop
        token (or an EOS, unless ignored) past min_tokens, "length" at max_tokens, else
        None. (A resumed leg whose tokens are already over has nothing to compute.)"""
        return self._reason(sampling, outputs[-1], len(outputs)) if outputs else None

    def _reason(self, sampling: SamplingParams, last: int, count: int) -> str | None:
        """`finish_reason_of` an output of `count` tokens that ends with `last`."""
        stops = last in sampling.stop_set or (last in self.eos_ids
                                                   and not sampling.ignore_eos)
        if stops and count > sampling.min_tokens:
            return "stop"
        return "length" if count >= sampling.max_tokens else None

    def _finish(self, seq: Sequence, reason: str | None, error: str | None = None) -> None:
        if seq.status is SeqStatus.FINISHED:
            return
        self.connector.before_step()  # no put may still read blocks that are freed below
        if error is None and seq.block_table:
            failure = self.connector.on_finish(seq)
            error = None if failure is None else failure.reason
        if error is not None:
            self.connector.on_abort(seq)
        seq.finish_reason, seq.error = (None, error) if error else (reason, None)
        self.scheduler.finish(seq)
        self.forget(seq)
        self._finished.append(StepOutput(seq.request_id, None, seq.finish_reason, seq.error,
                                         self.stats(seq), self.clock.now()))

    def forget(self, seq: Sequence) -> None:
        """`seq` has finished; a subclass drops what it kept for it."""

    @staticmethod
    def stats(seq: Sequence) -> dict[str, float]:
        return {"num_prompt_tokens": seq.num_prompt_tokens,
                "num_cached_tokens": seq.num_cached_tokens,
                "num_pool_tokens": seq.num_pool_tokens,
                "pool_load_s": seq.pool_load_s,
                "num_output_tokens": seq.num_output_tokens}

    # -- pushed KV ---------------------------------------------------------------------------

    def reserve_blocks(self, num_tokens: int) -> list[int] | None:
        """Fresh blocks for `num_tokens` of KV that another worker will write; None if the
        cache has no room. Give them back with `blocks.release`, or to `start_pushed`."""
        self.connector.before_step()
        needed = -(-num_tokens // self.config.block_size) + 1
        if needed > self.blocks.num_free_blocks:
            return None
        return self.blocks.allocate_blocks(needed - 1)

    def start_pushed(self, request_id: str, prompt: list[int], first_token: int,
                     sampling: SamplingParams, block_ids: list[int]) -> Sequence:
        """Continue a request whose prompt KV was written into `block_ids`."""
        self.check_new_id(request_id)
        seq = self.new_sequence(request_id, prompt, sampling, kv_source=KVSource.PUSH)
        seq.block_table = list(block_ids)
        seq.num_computed_tokens = len(prompt)
        self.blocks.commit(seq)
        self.scheduler.add_running(seq)
        self.continue_with(seq, first_token)
        return seq

    def continue_with(self, seq: Sequence, first_token: int) -> None:
        """Append the first token a prefill worker sampled; it is this leg's first output."""
        seq.append(first_token)
        self._finished.append(StepOutput(seq.request_id, first_token))
        reason = self._stop_reason(seq)
        if reason is not None:
            self._finish(seq, reason)

    # -- offline use -------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> list[list[int]]:
        ids = [f"gen-{i}" for i in range(len(prompts))]
        seqs = [self.add_request(rid, p, sampling) for rid, p in zip(ids, prompts, strict=True)]
        while self.has_work:
            for out in self.step():
                if out.error:
                    raise InvalidArgument(f"{out.request_id}: {out.error}")
        return [s.output_ids for s in seqs]
