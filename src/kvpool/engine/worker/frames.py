"""A /generate stream's frames from the engine's step outputs (sans-I/O: lists in, messages
out). A frame (`PlainFrame`, or a `TokensLine` with logprobs) holds every token of its
request that one engine step made; with a stream interval N > 1, the first frame goes at once
(time to first token is not traded), then one every N tokens, and whatever is held goes with
the finish:

    steps:     [t1]  [t2]  [t3]  [t4]  [t5, finish]
    interval 1: F(t1) F(t2) F(t3) F(t4) F(t5) Finish
    interval 2: F(t1)       F(t2,t3)    F(t4,t5) Finish

Fewer frames is fewer lines written, relayed and parsed (vLLM's --stream-interval trades
the same way: smoothness for host overhead). The finish line counts every token sent.

With an `SseText` (GenerateRequest.sse) each frame also carries its text's SSE events, and a
stop string ends the stream there: the frame keeps the tokens up to the one that completes it,
a finish line `stop` follows, and `done` is set (the caller stops reading the engine, which
aborts the request).
"""

from __future__ import annotations

from kvpool.engine.core import StepOutput
from kvpool.engine.sequence import TokenLogprob
from kvpool.engine.worker.messages import FinishLine, Frame, PlainFrame, TokensLine
from kvpool.engine.worker.sse_text import SseText


class FrameBuilder:
    def __init__(self, interval: int = 1, text: SseText | None = None) -> None:
        self.interval = interval
        self.text = text
        self.done = False
        """The stream has ended (a finish line was made)."""
        self.num_tokens = 0
        """Tokens in the frames made so far."""
        self._held: list[StepOutput] = []
        self._stats: dict[str, float] = {}
        """The request's figures, from its first token's output (for a finish at a stop
        string, which the engine's own finish never follows)."""

    def add(self, outputs: list[StepOutput]) -> list[Frame | FinishLine]:
        """The lines to send after one step's `outputs` (of this request, in order)."""
        if self.done:
            return []
        if len(outputs) == 1 and self.interval == 1 and self.text is None and not self._held:
            out = outputs[0]  # most steps: one token, no logprobs, not the last
            if out.token_id is not None and out.finish_reason is None and \
                    out.logprob is None and out.prompt_logprobs is None:
                self._stats = out.stats or self._stats
                first = self.num_tokens == 0
                self.num_tokens += 1
                return [PlainFrame([out.token_id], [out.time_s], None,
                                   reuse=self._reuse() if first else None)]
        lines: list[Frame | FinishLine] = []
        for out in outputs:
            if out.token_id is not None:
                self._held.append(out)
                self._stats = out.stats or self._stats
            if out.finish_reason is not None:
                lines.extend(self._frame())
                if not self.done:
                    lines.append(self._finish(out))
                    self.done = True
                return lines
        if self._held and (self.num_tokens == 0 or len(self._held) >= self.interval):
            lines.extend(self._frame())
        return lines

    def _frame(self) -> list[Frame | FinishLine]:
        held, self._held = self._held, []
        if not held or self.done:
            return []
        events = None
        if self.text is not None:
            n, events = self.text.take([o.token_id for o in held if o.token_id is not None])
            held = held[:n]
        reuse = self._reuse() if self.num_tokens == 0 and held else None
        self.num_tokens += len(held)
        logprobs: list[TokenLogprob | None] | None = None
        if any(o.logprob is not None for o in held):
            logprobs = [o.logprob for o in held]
        prompt = next((o.prompt_logprobs for o in held if o.prompt_logprobs is not None), None)
        lines: list[Frame | FinishLine] = []
        ids = [o.token_id for o in held if o.token_id is not None]  # every held one has one
        stamps = [o.time_s for o in held]
        if held and logprobs is None and prompt is None:  # most steps: no pydantic
            lines.append(PlainFrame(ids, stamps, events, reuse=reuse))
        elif held:
            lines.append(TokensLine(token_ids=ids, t=stamps, logprobs=logprobs,
                                    prompt_logprobs=None if prompt is None else list(prompt),
                                    sse=events, reuse=reuse))
        if self.text is not None and self.text.stopped:
            lines.append(self._finish_line("stop", self._stats,
                                           self.text.finish_events("stop")))
            self.done = True
        return lines

    def _reuse(self) -> list[int] | None:
        """The first frame's [cached, pool] prompt tokens, where the engine reported them."""
        stats = self._stats
        if "num_cached_tokens" not in stats:
            return None
        return [int(stats["num_cached_tokens"]), int(stats.get("num_pool_tokens", 0))]

    def _finish(self, out: StepOutput) -> FinishLine:
        assert out.finish_reason is not None
        if self.text is None:
            return self._finish_line(out.finish_reason, out.stats, None)
        events = self.text.finish_events(out.finish_reason)  # may find a stop in its tail
        return self._finish_line(self.text.finish_reason(out.finish_reason), out.stats, events)

    def _finish_line(self, reason: str, stats: dict[str, float],
                     events: str | None) -> FinishLine:
        return FinishLine(finish_reason=reason, num_output_tokens=self.num_tokens,
                          num_cached_tokens=int(stats.get("num_cached_tokens", 0)),
                          num_pool_tokens=int(stats.get("num_pool_tokens", 0)), sse=events)
