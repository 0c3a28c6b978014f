"""A decoding worker's side of `kvpool proxy --worker-sse`: the response's SSE text chunks made
where the tokens are, from the same pieces the proxy uses (serve/text.py TextStream,
serve/protocol.py TextChunks and chunk), so the bytes are the proxy's own.

    SseText(spec, decode, sent_ids, skip)   sent_ids: output the client has (a resumed leg);
                                            skip: the echo of the prefill's token (its text
                                            went out from the proxy)
    take(ids) -> (n, events)   n: the tokens that count (all, or up to the one that
                               completes a stop string); events: "" while the text is held
    finish_events(reason)      the held text's event, if any, then the finish chunk

The text state after `sent_ids` is the one the previous leg had after the same tokens (the
stream is deterministic), so a resumed leg goes on with neither a gap nor a repeat.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from kvpool.engine.worker.messages import SseSpec
from kvpool.serve.protocol import TextChunks, chunk, sse
from kvpool.serve.text import TextStream


class SseText:
    def __init__(self, spec: SseSpec, decode: Callable[[Sequence[int]], str],
                 sent_ids: Sequence[int] = (), skip: int = 0,
                 pieces: Mapping[int, bytes] | None = None) -> None:
        self.spec = spec
        self.text = TextStream(decode, spec.stop, pieces)
        if sent_ids:
            self.text.push_many(sent_ids)
        self._skip = skip
        self._chunks = TextChunks(spec.kind, spec.id, spec.model, spec.index)

    @property
    def stopped(self) -> bool:
        return self.text.stopped

    def take(self, ids: Sequence[int]) -> tuple[int, str]:
        n = 0
        if self._skip and ids:
            self.text.push(ids[0])
            self._skip, ids, n = 0, ids[1:], 1
        if not ids or self.text.stopped:
            return n, ""
        before = self.text.num_tokens
        delta = self.text.push_many(ids)
        return n + self.text.num_tokens - before, self._events(delta.text)

    def finish_events(self, reason: str) -> str:
        """The held text's event, if any, then the finish chunk: `reason`, or "stop" where a
        stop string ends in the held text (`finish_reason` says which)."""
        tail = "" if self.text.stopped else self.text.flush()
        reason = self.finish_reason(reason)
        s = self.spec
        return self._events(tail) + sse(chunk(s.kind, s.id, s.model, None, reason,
                                              index=s.index)).decode()

    def finish_reason(self, reason: str) -> str:
        """The stream's finish reason, given the engine's: "stop" once a stop string ended
        the text (in the held tail too, found at the finish)."""
        return "stop" if self.text.stopped else reason

    def _events(self, text: str) -> str:
        return self._chunks.sse(text).decode() if text else ""
