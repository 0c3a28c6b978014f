"""The /generate stream's frames: FrameBuilder (per step, or every N tokens after the first),
the mailbox that wakes the event loop once per engine step, and the proxy's frame parser
(`generate_line` over `ReplyReader`) fuzzed with seeded random frames, splits and mutations,
and `read_frames`, which merges the plain frames of one read."""

from __future__ import annotations

import asyncio
import json
import random
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.engine.core import StepOutput
from kvpool.engine.sequence import TokenLogprob
from kvpool.engine.worker.frames import FrameBuilder
from kvpool.engine.worker.mailbox import StepMailbox, StepQueue
from kvpool.engine.worker.messages import (
    FinishLine,
    Frame,
    PlainFrame,
    SseSpec,
    TokenLine,
    TokensLine,
    generate_line,
    ndjson_line,
    read_frames,
)
from kvpool.engine.worker.sse_text import SseText
from kvpool.errors import WorkerCallError
from kvpool.serve.ndjson_reply import ReplyReader


def tok(i: int, t: float = 0.0, lp: bool = False) -> StepOutput:
    return StepOutput("r", i, time_s=t, logprob=TokenLogprob(i, -0.5, ((i, -0.5),)) if lp else None)


def end(reason: str = "length") -> StepOutput:
    return StepOutput("r", None, reason, stats={"num_cached_tokens": 4.0})


def shape(lines: list[Frame | FinishLine]) -> list[object]:
    return [line.token_ids if isinstance(line, Frame) else
            (line.finish_reason, line.num_output_tokens) for line in lines]


def test_interval_one_is_a_frame_per_step() -> None:
    f = FrameBuilder()
    assert shape(f.add([tok(1, 1.0)])) == [[1]]
    assert shape(f.add([tok(2, 2.0)])) == [[2]]
    got = f.add([tok(3, 3.0), end()])
    assert shape(got) == [[3], ("length", 3)]
    assert isinstance(got[0], PlainFrame) and got[0].t == [3.0] and got[0].logprobs is None
    assert isinstance(got[1], FinishLine) and got[1].num_cached_tokens == 4


def test_an_interval_sends_the_first_at_once_then_every_n_and_the_rest_with_the_finish() -> None:
    f = FrameBuilder(3)
    steps = [[tok(1)], [tok(2)], [tok(3)], [tok(4)], [tok(5)], [tok(6)], [end()]]
    assert [shape(f.add(s)) for s in steps] == [[[1]], [], [], [[2, 3, 4]], [], [], [[5, 6], ("length", 6)]]


def test_a_frame_carries_its_logprobs_and_stamps_in_order() -> None:
    f = FrameBuilder(2)
    f.add([tok(1, 1.0, lp=True)])
    (frame,) = f.add([tok(2, 2.0, lp=True), tok(3, 2.0, lp=True)])
    assert isinstance(frame, TokensLine) and frame.t == [2.0, 2.0]
    assert [lp.token_id for lp in frame.logprobs or [] if lp] == [2, 3]
    again = TokensLine.model_validate_json(frame.model_dump_json(exclude_none=True))
    assert again == frame and [one.token_id for one in again.split()] == [2, 3]


def test_a_stop_string_ends_the_stream_with_the_prompts_reuse() -> None:
    """With the response's SSE text made here, a stop string ends the stream at the token
    that completes it: the finish line `stop` reports the prompt's reuse from the first
    token's output (the engine's own finish, which carries it too, never comes)."""
    spec = SseSpec(kind="completion", id="cmpl-1", model="m", stop=["cd"])
    f = FrameBuilder(1, SseText(spec, lambda ids: "".join("abcdef"[i] for i in ids)))
    # ("c" is held as the start of "cd"; "d" completes it; "e" is never reached)
    first = StepOutput("r", 0, time_s=1.0, stats={"num_cached_tokens": 32.0,
                                                  "num_pool_tokens": 16.0})
    assert shape(f.add([first])) == [[0]]
    assert shape(f.add([tok(1)])) == [[1]]
    got = f.add([tok(2), tok(3), tok(4)])
    assert shape(got) == [[2, 3], ("stop", 4)] and f.done
    assert isinstance(got[1], FinishLine)
    assert (got[1].num_cached_tokens, got[1].num_pool_tokens) == (32, 16)
    assert got[1].sse is not None and '"finish_reason":"stop"' in got[1].sse


@pytest.mark.parametrize("interval", [1, 3])
def test_the_first_frame_says_the_prompts_reuse(interval: int) -> None:
    """A proxy that ends the stream at a stop string itself never reads the finish line:
    the request's first frame carries the prompt's reuse too ([own cache, pool]), and no
    other frame does."""
    f = FrameBuilder(interval)
    first = StepOutput("r", 0, time_s=1.0, stats={"num_cached_tokens": 32.0,
                                                  "num_pool_tokens": 16.0})
    lines = f.add([first]) + f.add([tok(1)]) + f.add([tok(2)]) + f.add([tok(3), end()])
    frames = [x for x in lines if isinstance(x, PlainFrame)]
    assert frames[0].reuse == [32, 16] and all(x.reuse is None for x in frames[1:])
    assert b'"reuse":[32,16]' in ndjson_line(frames[0])
    assert b"reuse" not in ndjson_line(frames[1])


def test_a_stop_string_in_the_character_the_output_ended_inside_of_is_a_stop() -> None:
    """The engine's last token leaves a character unfinished, and a stop string ends in
    what the stream held: the finish chunk and line say `stop`, and the stop string's text
    is not sent."""
    spec = SseSpec(kind="completion", id="cmpl-1", model="m", stop=["\ufffd"])
    pieces = {0: b"ab", 1: b" \xc3"}  # 1: a space and half of a character

    def decode(ids: list[int]) -> str:
        return b"".join(pieces[i] for i in ids).decode("utf-8", "replace")

    f = FrameBuilder(1, SseText(spec, decode, pieces=pieces))
    assert shape(f.add([tok(0)])) == [[0]]
    got = f.add([tok(1), end("length")])
    assert shape(got) == [[1], ("stop", 2)] and f.done
    assert isinstance(got[1], FinishLine) and got[1].sse is not None
    texts = [json.loads(e[len("data: "):])["choices"][0]["text"]
             for e in got[1].sse.split("\n\n") if e.startswith("data: ")]
    assert texts == [" ", ""] and '"finish_reason":"stop"' in got[1].sse


def test_random_steps_and_intervals_lose_and_reorder_nothing() -> None:
    rng = random.Random(11)
    for _ in range(300):
        interval, n = rng.randint(1, 6), rng.randint(1, 40)
        outs = [tok(i) for i in range(n)]
        cuts = sorted(rng.sample(range(1, n), rng.randint(0, n - 1))) if n > 1 else []
        steps = [outs[a:b] for a, b in zip([0, *cuts], [*cuts, n], strict=True)]
        steps[-1] = [*steps[-1], end()]
        f = FrameBuilder(interval)
        lines = [line for s in steps for line in f.add(s)]
        frames = [x for x in lines if isinstance(x, Frame)]
        assert [t for x in frames for t in x.token_ids] == list(range(n))
        assert frames[0].token_ids == [o.token_id for o in steps[0] if o.token_id is not None]
        assert all(len(x.token_ids) >= interval for x in frames[1:-1])
        assert isinstance(lines[-1], FinishLine) and lines[-1].num_output_tokens == n


def test_a_step_of_one_token_makes_the_frame_the_general_path_makes() -> None:
    """Most steps bring one token without logprobs, which goes straight to its frame: the
    same lines as a step that also carries an output without a token (which takes the
    general path), over random runs with logprob steps, stats and a finish."""
    rng = random.Random(5)
    for _ in range(200):
        n = rng.randint(1, 30)
        steps = [[StepOutput("r", i, time_s=float(i), stats={"num_cached_tokens": float(i)}
                             if rng.random() < 0.2 else {},
                             logprob=TokenLogprob(i, -0.5, ((i, -0.5),))
                             if rng.random() < 0.2 else None)] for i in range(n)]
        steps[-1] = [*steps[-1], end()]
        fast, general = FrameBuilder(), FrameBuilder()
        got = [line for s in steps for line in fast.add(s)]
        want = [line for s in steps for line in general.add([*s, StepOutput("r", None)])]
        assert got == want and fast.num_tokens == general.num_tokens == n
        assert all(isinstance(x, PlainFrame) == (x.logprobs is None) for x in got  # type: ignore[union-attr]
                   if isinstance(x, Frame))


def test_the_mailbox_wakes_each_loop_once_per_step() -> None:
    async def go() -> None:
        loop = asyncio.get_running_loop()
        wakes = []
        real = loop.call_soon_threadsafe

        def counted(*args: object) -> object:
            wakes.append(1)
            return real(*args)  # type: ignore[arg-type]
        loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
        box = StepMailbox()
        queues = [StepQueue(loop) for _ in range(8)]
        listeners = [box.listener(loop, q) for q in queues]

        def engine_thread() -> None:  # two steps, each with a token for every request
            for step in range(2):
                for i, listen in enumerate(listeners):
                    listen([StepOutput(f"r{i}", step)])
                box.flush()
            box.flush()  # nothing pending: no wake-up
        thread = threading.Thread(target=engine_thread)
        thread.start()
        got = [[(await q.get())[0].token_id, (await q.get())[0].token_id] for q in queues]
        thread.join()
        assert got == [[0, 1]] * 8 and len(wakes) == 2
    asyncio.run(go())


def test_a_step_queue_hands_outputs_over_in_order_and_keeps_them_through_a_cancel() -> None:
    async def go() -> None:
        q = StepQueue(asyncio.get_running_loop())
        waiting = asyncio.ensure_future(q.get())
        await asyncio.sleep(0)
        waiting.cancel()  # as the stream's silence timer cancels a read
        await asyncio.wait([waiting])
        q.put_nowait([StepOutput("r", 1)])
        q.put_nowait([StepOutput("r", 2)])
        assert not q.empty() and (await q.get())[0].token_id == 1
        assert q.get_nowait()[0].token_id == 2 and q.empty()
        later = asyncio.ensure_future(q.get())
        await asyncio.sleep(0)
        q.put_nowait([StepOutput("r", 3)])
        assert (await later)[0].token_id == 3
    asyncio.run(go())


def frame_bytes(rng: random.Random) -> tuple[list[bytes], list[int]]:
    lines, ids = [], []
    for _ in range(rng.randint(1, 12)):
        frame = [rng.randint(0, 50000) for _ in range(rng.randint(1, 5))]
        lps = [TokenLogprob(t, -rng.random(), ((t, -0.1),)) for t in frame] \
            if rng.random() < 0.5 else None
        line = TokensLine(token_ids=frame, t=[rng.random()] * len(frame), logprobs=lps)
        lines.append(ndjson_line(line))
        ids += frame
    lines.append(FinishLine(finish_reason="length", num_output_tokens=len(ids))
                 .model_dump_json().encode() + b"\n")
    return lines, ids


def test_frames_read_back_whatever_the_chunking_and_splits() -> None:
    rng = random.Random(5)
    for _ in range(200):
        lines, ids = frame_bytes(rng)
        data = b"".join(lines)
        cuts = sorted(rng.sample(range(1, len(data)), min(len(data) - 1, rng.randint(0, 6))))
        chunks = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]
        raw = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"".join(
            b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\n\r\n"
        reader, got = ReplyReader(), []
        at = 0
        while at < len(raw):
            step = rng.randint(1, 64)
            reader.feed(raw[at:at + step])
            at += step
            got += [generate_line("http://w", line) for line in reader.lines()]
        assert reader.done
        assert [t for m in got if isinstance(m, Frame) for t in m.token_ids] == ids
        assert isinstance(got[-1], FinishLine)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=2**31), min_size=1, max_size=8),
       st.floats(allow_nan=False, allow_infinity=False), st.booleans())
def test_a_frame_line_is_pydantics_json(ids: list[int], t: float, with_sse: bool) -> None:
    """The plain frame's own encoder and pydantic's give the same JSON, read back alike."""
    line = TokensLine(token_ids=ids, t=[t] * len(ids), sse="data: x\n\n" if with_sse else None)
    fast = ndjson_line(line)
    assert fast.endswith(b"\n") and json.loads(fast) == json.loads(
        line.model_dump_json(exclude_none=True))
    assert generate_line("http://w", fast) == line


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200), st.integers(min_value=0))
def test_a_mangled_frame_is_a_worker_call_error_or_a_valid_frame(junk: bytes, where: int) -> None:
    line = b'{"type":"tokens","token_ids":[3,4],"t":[1.0,1.0]}'
    at = where % (len(line) + 1)
    for candidate in (junk, line[:at] + junk + line[at:], line[:at]):
        try:
            msg = generate_line("http://w", candidate)
        except WorkerCallError:
            continue
        assert isinstance(msg, TokensLine | FinishLine)
        if isinstance(msg, TokensLine):
            assert len(msg.t) == len(msg.token_ids) >= 1


def test_a_one_token_line_is_a_frame_of_one_and_misaligned_frames_are_refused() -> None:
    msg = generate_line("http://w", b'{"type":"token","token_id":9,"t":2.0}')
    assert isinstance(msg, TokensLine) and (msg.token_ids, msg.t) == ([9], [2.0])
    assert TokensLine.of(TokenLine(token_id=9, t=2.0)) == msg
    for bad in (b'{"type":"tokens","token_ids":[1,2],"t":[1.0]}',
                b'{"type":"tokens","token_ids":[],"t":[]}',
                b'{"type":"tokens","token_ids":[1],"t":[1.0],"logprobs":[]}'):
        with pytest.raises(WorkerCallError, match="malformed line"):
            generate_line("http://w", bad)


def as_lines(frames: list[Frame | FinishLine]) -> list[TokensLine | FinishLine]:
    """Plain frames as the TokensLine of the same JSON (what generate_line reads)."""
    return [TokensLine(token_ids=m.token_ids, t=m.t, sse=m.sse) if isinstance(m, PlainFrame)
            else m for m in frames]


def _per_line(lines: list[bytes]) -> list[TokensLine | FinishLine]:
    return [generate_line("http://w", line) for line in lines]


def test_read_frames_merges_runs_of_plain_frames_and_keeps_the_rest() -> None:
    """Seeded random streams (frames with and without logprobs, a finish line) cut at random
    into reads: unmerged, read_frames gives generate_line's frames; merged, the same tokens,
    stamps and logprob frames, and no two plain frames in a row from one read."""
    rng = random.Random(11)
    for _ in range(300):
        lines, ids = frame_bytes(rng)
        cuts = sorted(rng.sample(range(1, len(lines)), min(len(lines) - 1, rng.randint(0, 4))))
        plain: list[Frame | FinishLine] = []
        merged: list[Frame | FinishLine] = []
        for a, b in zip([0, *cuts], [*cuts, len(lines)], strict=True):
            one, used, error = read_frames("http://w", lines[a:b], merge=False)
            assert (used, error) == (b - a, None)
            plain += one
            one, used, error = read_frames("http://w", lines[a:b])
            assert (used, error) == (b - a, None)
            assert not any(_plain(x) and _plain(y) for x, y in zip(one, one[1:], strict=False))
            merged += one
        assert as_lines(plain) == _per_line(lines)
        assert _tokens(merged) == _tokens(plain) and _tokens(merged)[0] == ids
        assert [m for m in merged if not _plain(m)] == [m for m in plain if not _plain(m)]


def test_read_frames_merges_sse_frames_into_their_text_in_order() -> None:
    """Frames that carry SSE text (GenerateRequest.sse, held text as "") are plain frames:
    merged, one frame per run holds the tokens, stamps and the text's events in order, as
    the unmerged frames do; a merged run of held text carries none."""
    rng = random.Random(23)
    for _ in range(300):
        lines, ids, events = [], [], []
        for k in range(rng.randint(1, 10)):
            frame = [rng.randint(0, 50000) for _ in range(rng.randint(1, 4))]
            text = rng.choice(["", f'data: {{"text": "\u00e9{k}\\n\""}}\n\n'])
            lines.append(ndjson_line(TokensLine(token_ids=frame, t=[float(k)] * len(frame),
                                                sse=text)))
            ids += frame
            events.append(text)
        cuts = sorted(rng.sample(range(1, len(lines)), min(len(lines) - 1, rng.randint(0, 3))))
        got: list[Frame | FinishLine] = []
        for a, b in zip([0, *cuts], [*cuts, len(lines)], strict=True):
            one, used, error = read_frames("http://w", lines[a:b])
            assert (used, error) == (b - a, None) and len(one) == 1
            assert "".join(events[a:b]) == (one[0].sse or "")  # type: ignore[union-attr]
            got += one
        assert _tokens(got)[0] == ids
        unmerged, _, _ = read_frames("http://w", lines, merge=False)
        assert [m.sse for m in unmerged] == events  # type: ignore[union-attr]


def _plain(m: Frame | FinishLine) -> bool:
    return isinstance(m, Frame) and m.logprobs is None


def _tokens(frames: list[Frame | FinishLine]) -> tuple[list[int], list[float]]:
    lines = [m for m in frames if isinstance(m, Frame)]
    return [t for m in lines for t in m.token_ids], [t for m in lines for t in m.t]


def test_read_frames_stops_at_the_finish_and_at_a_bad_line_after_its_frames() -> None:
    plain = [b'{"type":"tokens","token_ids":[%d],"t":[1.0]}' % i for i in range(3)]
    finish = b'{"type":"finish","finish_reason":"stop","num_output_tokens":3}'
    frames, used, error = read_frames("http://w", [*plain, finish, plain[0]])
    assert used == 4 and error is None
    assert isinstance(frames[0], PlainFrame) and frames[0].token_ids == [0, 1, 2]
    assert frames[1:] == [FinishLine(finish_reason="stop", num_output_tokens=3)]
    for bad, match in ((b'{"type":"error","error":"engine died"}', "engine died"),
                       (b'{"type":"tokens","token_ids":[1,2],"t":[1.0]}', "malformed line"),
                       (b'{"token_ids":[1],"t":[1.0]}', "malformed line"),  # no type
                       (b'{"type":"~"}', "malformed line")):
        frames, used, error = read_frames("http://w", [*plain[:2], bad, plain[2]])
        assert used == 2 and isinstance(error, WorkerCallError) and match in str(error)
        assert frames == [PlainFrame([0, 1], [1.0, 1.0])]


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200), st.integers(min_value=0))
def test_read_frames_reads_a_mangled_line_as_generate_line_does(junk: bytes, where: int) -> None:
    """The plain frames' own reader takes nothing that generate_line would refuse, and reads
    alike what both take."""
    line = b'{"type":"tokens","token_ids":[3,4],"t":[1.0,1.0]}'
    at = where % (len(line) + 1)
    for candidate in (junk, line[:at] + junk + line[at:], line[:at]):
        frames, used, error = read_frames("http://w", [candidate])
        try:
            want = generate_line("http://w", candidate)
        except WorkerCallError as exc:
            assert (frames, used, str(error)) == ([], 0, str(exc))
            continue
        assert (as_lines(frames), used, error) == ([want], 1, None)
