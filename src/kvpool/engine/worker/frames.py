"""A /generate stream's frames from the engine's step outputs (sans-I/O: lists in, messages
out). A frame (`TokensLine`) holds every token of its request that one engine step made; with
a stream interval N > 1, the first frame goes at once (time to first token is not traded),
then one every N tokens, and whatever is held goes with the finish:

    steps:     [t1]  [t2]  [t3]  [t4]  [t5, finish]
    interval 1: F(t1) F(t2) F(t3) F(t4) F(t5) Finish
    interval 2: F(t1)       F(t2,t3)    F(t4,t5) Finish

Fewer frames is fewer lines written, relayed and parsed (vLLM's --stream-interval trades
the same way: smoothness for host overhead). The finish line counts every token sent.
"""

from __future__ import annotations

from kvpool.engine.core import StepOutput
from kvpool.engine.sequence import TokenLogprob
from kvpool.engine.worker.messages import FinishLine, TokensLine


class FrameBuilder:
    def __init__(self, interval: int = 1) -> None:
        self.interval = interval
        self.num_tokens = 0
        """Tokens in the frames made so far."""
        self._held: list[StepOutput] = []

    def add(self, outputs: list[StepOutput]) -> list[TokensLine | FinishLine]:
        """The lines to send after one step's `outputs` (of this request, in order)."""
        lines: list[TokensLine | FinishLine] = []
        for out in outputs:
            if out.token_id is not None:
                self._held.append(out)
            if out.finish_reason is not None:
                lines.extend(self._frame())
                lines.append(self._finish(out))
                return lines
        if self._held and (self.num_tokens == 0 or len(self._held) >= self.interval):
            lines.extend(self._frame())
        return lines

    def _frame(self) -> list[TokensLine]:
        held, self._held = self._held, []
        if not held:
            return []
        self.num_tokens += len(held)
        logprobs: list[TokenLogprob | None] | None = None
        if any(o.logprob is not None for o in held):
            logprobs = [o.logprob for o in held]
        prompt = next((o.prompt_logprobs for o in held if o.prompt_logprobs is not None), None)
        return [TokensLine.model_construct(  # the engine's own values: nothing to validate
            type="tokens", token_ids=[o.token_id for o in held], t=[o.time_s for o in held],
            logprobs=logprobs, prompt_logprobs=None if prompt is None else list(prompt))]

    def _finish(self, out: StepOutput) -> FinishLine:
        assert out.finish_reason is not None
        return FinishLine(finish_reason=out.finish_reason, num_output_tokens=self.num_tokens,
                          num_cached_tokens=int(out.stats.get("num_cached_tokens", 0)),
                          num_pool_tokens=int(out.stats.get("num_pool_tokens", 0)))
