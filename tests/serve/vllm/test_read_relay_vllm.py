"""The vllm backend's relay in the read callback (`read_relay` over `token_chunks`): the chunks of tokens a read
of a vLLM stream begins with go to the run as one frame; the chunk with the finish reason, the
usage, handoff parameters, an error, and everything after them are the reader's."""

from __future__ import annotations

from kvpool.engine.worker.messages import PlainFrame
from kvpool.serve.backend import read_relay
from kvpool.serve.ndjson_reply import ReplyReader
from kvpool.serve.vllm.stream import Tally
from kvpool.serve.vllm.wire import token_chunks
from tests.serve.test_worker_stream import HEAD

TOKENS = b'data: {"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":' \
    b'[{"index":0,"text":" hi","logprobs":null,"finish_reason":null,"token_ids":[7,8]}]}'
MORE = b'data: {"choices":[{"index":0,"text":"!","token_ids":[9]}]}'
FINISH = b'data: {"choices":[{"index":0,"text":"","token_ids":[2],"finish_reason":"stop"}]}'
USAGE = b'data: {"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":3,' \
    b'"prompt_tokens_details":{"cached_tokens":4}}}'
HANDOFF = b'data: {"choices":[{"text":"","token_ids":[]}],"kv_transfer_params":{"a":1}}'
ERROR = b'data: {"error":{"message":"engine dead"}}'


class _Relay:
    def __init__(self, takes: bool = True) -> None:
        self.takes = takes
        self.frames: list[list[int]] = []

    def ready(self) -> bool:
        return True

    def take(self, frame: PlainFrame) -> bool:
        if self.takes:
            self.frames.append(frame.token_ids)
        return self.takes


def _reply(*lines: bytes) -> ReplyReader:
    reply = ReplyReader()
    body = b"".join(line + b"\n\n" for line in lines)
    reply.feed(HEAD + b"%x\r\n%s\r\n" % (len(body), body))
    return reply


def _ids(lines: list[bytes]) -> tuple[int, list[int] | None]:
    count, frame = token_chunks(lines)
    return count, None if frame is None else frame.token_ids


def test_the_chunks_of_tokens_a_read_begins_with_are_counted() -> None:
    assert _ids([TOKENS, b": keep-alive", MORE, FINISH, MORE]) == (3, [7, 8, 9])
    for end in (FINISH, USAGE, HANDOFF, ERROR, b"data: {not json"):
        assert _ids([TOKENS, end, MORE]) == (1, [7, 8]), end
    assert _ids([MORE, b"data: [DONE]"]) == (2, [9])
    assert _ids([b"data: [DONE]"]) == (1, None) and _ids([FINISH]) == (0, None)


def test_a_relayed_vllm_stream_leaves_its_end_to_the_reader() -> None:
    relay, tally, told = _Relay(), Tally(), []
    take = read_relay(relay, token_chunks, lambda: told.append(1), tally.add)
    reply = _reply(TOKENS, MORE)
    assert take(reply) is True and relay.frames == [[7, 8, 9]] and tally.num_tokens == 3
    reply.feed(b"%x\r\n%s\r\n" % (len(MORE + b"\n\n" + FINISH + b"\n\n" + USAGE + b"\n\n"),
                                 MORE + b"\n\n" + FINISH + b"\n\n" + USAGE + b"\n\n"))
    assert take(reply) is False
    assert relay.frames == [[7, 8, 9], [9]] and tally.num_tokens == 4 and told == [1, 1]
    assert reply.lines() == [FINISH, USAGE]
    reply.feed(b"%x\r\n%s\r\n" % (len(MORE) + 2, MORE + b"\n\n"))
    assert take(reply) is False and reply.lines() == [MORE]  # nothing taken after the end


def test_a_frame_the_run_does_not_take_goes_back_whole() -> None:
    tally = Tally()
    take = read_relay(_Relay(takes=False), token_chunks, lambda: None, tally.add)
    reply = _reply(TOKENS, MORE)
    assert take(reply) is False and tally.num_tokens == 0
    assert reply.lines() == [TOKENS, MORE]
